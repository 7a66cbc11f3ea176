// Forward pass of LayerNorm and RMSNorm, one kernel for both (common.cuh's is_ln: LayerNorm where
// the host gives the mean's output, `ln`), but y in float8 (norm_fwd_q) and rows with early
// parameters, whose norm is fixed.
//
// Geometry (decided by cupyln/_plan.py alone): blockDim = (tpr, rows per block). A row is held
// in registers as chunks of tpr * NPT * VEC elements; thread t owns vectors k * tpr + t of a
// chunk. When the row is one chunk (the common case) x is read from memory once; longer rows
// are read twice (statistics, then output), or on sm_90 split over the blocks of a cluster
// (CL > 1: blockDim = (tpr, 1), gridDim.y = CL). Where blocks loop over rows, the staged variant
// (STAGE, CUDA sm_80 on) copies each block's next rows into shared memory while it reduces and
// writes these, as the backward does. Statistics are exact per chunk (sum, then centered
// sum of squares) and merged across chunks with Chan's formula: never E[x^2] - E[x]^2.
#include "cluster.cuh"


// Sum over a row's threads: of one block, or (CL > 1) of the CL blocks of a cluster.
template <int CL, int WARP, int TPR, typename C>
__device__ __forceinline__ void tile_allreduce(C (&v)[1], int phase) {
  if constexpr (CL > 1) cluster_allreduce<CL, cluster_slots<CL, WARP, 1024>(), WARP>(v, phase);
  else row_allreduce<WARP, TPR>(v, phase);
}

// Statistics of one chunk held in p, merged into the row's (n, mean, m2), identical on every
// thread of the row: exact two-pass on the chunk (sum, then centered sum of squares), then
// Chan's formula across chunks. RMSNorm keeps only the sum of squares (in m2). Two reductions
// per chunk, one barrier each (phase 2c and 2c + 1 alternate the buffers): faster than merging
// per-warp (count, mean, M2) after one barrier.
// A row of one chunk (CHUNKED = false) takes the chunk's statistics as they are, with
// `inv_cnt` = 1 / N: no division and no merge on the row's critical path. FULL: every vector
// lies below N (see fwd_rows). CL > 1: the chunk spans the CL blocks of a cluster (from c0, this
// block's part from t0), whose sums cluster_allreduce adds.
// EDGE: one more element `ex` of the row in this thread (a peeled head or tail element, where
// `has_ex`), counted in `inv_cnt` but outside the vectors.
// `p[k]`: the thread's k-th vector (an array in registers, or a SmemRow).
template <bool CHUNKED, int WARP, int VEC, int NPT, bool FULL, int TPR, int CL,
          bool EDGE = false, typename R, typename C>
__device__ __forceinline__ void chunk_stats(bool ln, const R& p, cl_i64 c0, cl_i64 t0, cl_i64 N,
                                            cl_i64 chunk, int phase, C inv_cnt, C& n, C& mean,
                                            C& m2, C ex = C(0), bool has_ex = false) {
  C s[1] = {C(0)};
  // Consecutive calls alternate the reduction buffers: LayerNorm calls twice per chunk (2p and
  // 2p + 1), RMSNorm once (p). racecheck found RMSNorm at 2p (always the same buffer) racing.
  if (!ln) {  // RMSNorm: the sum of squares alone
#pragma unroll
    for (int k = 0; k < NPT; ++k)
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const C v = (C)elem(p[k], j);
        s[0] += v * v;
      }
    if (EDGE && has_ex) s[0] += ex * ex;
    tile_allreduce<CL, WARP, TPR>(s, phase);
    m2 += s[0];
    return;
  }
#pragma unroll
  for (int k = 0; k < NPT; ++k)
#pragma unroll
    for (int j = 0; j < VEC; ++j) s[0] += (C)elem(p[k], j);
  if (EDGE && has_ex) s[0] += ex;
  tile_allreduce<CL, WARP, TPR>(s, 2 * phase);
  const C cnt = (C)(N - c0 < chunk ? N - c0 : chunk);
  const C cm = CHUNKED ? s[0] / cnt : cl_mul(s[0], inv_cnt);  // the stored mean, rounded
  C q[1] = {C(0)};
#pragma unroll
  for (int k = 0; k < NPT; ++k) {
    // past N the row holds zeros: centred on 0 there, they add nothing (one select per vector)
    const C ck = FULL || t0 + ((cl_i64)k * blockDim.x + threadIdx.x) * VEC < N ? cm : C(0);
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const C d = (C)elem(p[k], j) - ck;
      q[0] += d * d;
    }
  }
  if (EDGE && has_ex) q[0] += (ex - cm) * (ex - cm);
  tile_allreduce<CL, WARP, TPR>(q, 2 * phase + 1);
  if (CHUNKED) {
    chan_merge(n, mean, m2, cnt, cm, q[0]);
  } else {
    mean = cm;
    m2 = q[0];
  }
}

template <bool B> struct BoolC { static constexpr bool value = B; };

// Output of one chunk. gamma/beta come from `hg`/`hb` when HELD (loaded with the row), else
// they are read here; they stay packed until used (fewer live registers). FULL: as chunk_stats.
// ONE_PATH: one code path, an absent gamma taken as 1 and an absent beta as -0 (x + -0 is x, -0
// included), for kernels whose time is one row's chain. Beta is added in the product's rounding
// (one fused multiply-add) on every path: left to nvcc, the four cases fused it for float16
// rows but not for bfloat16 rows or without gamma, and kernels' outputs differed in the
// last bit.
// `emit(k, col, o)` takes the thread's vector k (at column col) of the output, o[VEC].
template <bool HELD, int VEC, int NPT, bool FULL, bool ONE_PATH = false, typename W, typename C,
          typename R, typename H, typename Emit>
__device__ __forceinline__ void chunk_outputs(const R (&p)[NPT], int c0, int N, C mu, C rstd,
                                              const W* __restrict__ gamma,
                                              const W* __restrict__ beta, const H (&hg)[NPT],
                                              const H (&hb)[NPT], Emit&& emit) {
#pragma unroll
  for (int k = 0; k < NPT; ++k) {
    const int col = c0 + (k * (int)blockDim.x + (int)threadIdx.x) * VEC;
    if (!FULL && col >= N) continue;
    C o[VEC];
    if constexpr (ONE_PATH) {
      static_assert(HELD, "one path: gamma/beta held");
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const C scale = rstd * (gamma ? (C)elem(hg[k], j) : C(1));
        o[j] = cl_fma((C)elem(p[k], j) - mu, scale, beta ? (C)elem(hb[k], j) : C(-0.0));
      }
    } else {
      // (x - mean) * (rstd * gamma) + beta: three operations per element (the last two fused),
      // with the gamma/beta cases unswitched here rather than tested per element
      auto out = [&](const auto& g, const auto& b, auto G, auto B) {
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          const C scale = decltype(G)::value ? rstd * (C)elem(g, j) : rstd;
          const C d = (C)elem(p[k], j) - mu;
          o[j] = decltype(B)::value ? cl_fma(d, scale, (C)elem(b, j)) : d * scale;
        }
      };
      auto cases = [&](const auto& g, const auto& b) {
        if (gamma) {
          if (beta) out(g, b, BoolC<true>(), BoolC<true>());
          else out(g, b, BoolC<true>(), BoolC<false>());
        } else {
          if (beta) out(g, b, BoolC<false>(), BoolC<true>());
          else out(g, b, BoolC<false>(), BoolC<false>());
        }
      };
      if constexpr (HELD) {
        cases(hg[k], hb[k]);
      } else {
        Pack<W, VEC> g, b;
        if (gamma) g = *reinterpret_cast<const Pack<W, VEC>*>(gamma + col);
        if (beta) b = *reinterpret_cast<const Pack<W, VEC>*>(beta + col);
        cases(g, b);
      }
    }
    emit(k, col, o);
  }
}

template <bool HELD, int VEC, int NPT, bool FULL, bool ONE_PATH = false, typename T, typename W,
          typename C, typename R, typename H>
__device__ __forceinline__ void write_chunk(const R (&p)[NPT], int c0, int N, C mu,
                                            C rstd, const W* __restrict__ gamma,
                                            const W* __restrict__ beta, T* __restrict__ yr,
                                            const H (&hg)[NPT], const H (&hb)[NPT]) {
  chunk_outputs<HELD, VEC, NPT, FULL, ONE_PATH>(
      p, c0, N, mu, rstd, gamma, beta, hg, hb,
      [&](int, int col, const C (&o)[VEC]) { store_vec<VEC>(yr + col, o); });
}

// A vector of y / scale in float8 (divide: a float -> float quotient), two elements a
// conversion, stored as 32-bit words where VEC allows (as bytes, the codes were taken apart
// and put together again). NANS: as cl_float8x2's.
template <int VEC, bool WORDS = VEC % 4 == 0> struct Float8Vec {
  typedef Pack<unsigned char, VEC> type;
};
template <int VEC> struct Float8Vec<VEC, true> { typedef Pack<unsigned, VEC / 4> type; };
template <bool E5M2, bool NANS, int VEC, typename C, typename D>
__device__ __forceinline__ typename Float8Vec<VEC>::type float8_pack(const C (&o)[VEC],
                                                                    D divide) {
  typename Float8Vec<VEC>::type q;
  auto two = [&](int j) {  // codes j and j + 1 (0 past the vector)
    return cl_float8x2<E5M2, NANS>(divide((float)o[j]), j + 1 < VEC ? divide((float)o[j + 1])
                                                                   : 0.0f);
  };
#pragma unroll
  for (int j = 0; j < VEC; j += VEC % 4 == 0 ? 4 : 2) {
    if constexpr (VEC % 4 == 0) {
      q.v[j / 4] = two(j) | two(j + 2) << 16;
    } else {
      const unsigned b = two(j);
      q.v[j] = (unsigned char)b;
      if (j + 1 < VEC) q.v[j + 1] = (unsigned char)(b >> 8);
    }
  }
  return q;
}

// Whether write_quantized flags a NaN per thread: where 16-byte vectors run, but for LayerNorm
// with gamma and beta wider than x (the flag's registers spilled there; in single elements
// they halved the resident blocks). Plain arguments, not template ones: HIP's
// __launch_bounds__ macro would split at their commas.
__host__ __device__ constexpr bool quant_flagged(int norm, int vec, int wbytes) {
  return vec > 1 && (norm == cln::rmsnorm || wbytes * vec <= 16);
}

// norm_fwd_q's launch bound (either scaling): single elements in blocks of up to 1024
// threads; the flagged kernels with 16-bit gamma held to 64 registers (four blocks of 256
// threads an SM), the other flagged ones to 80 (65536 / 768: three; 64 spilled); the rest at
// 512 (LayerNorm with 32-bit gamma lost at 80: it spilled).
__host__ __device__ constexpr int quant_max_threads(int norm, int vec, int wbytes) {
  return vec == 1 || (wbytes == 2 && quant_flagged(norm, vec, wbytes)) ? 1024
         : quant_flagged(norm, vec, wbytes)                           ? 768
                                                                       : 512;
}

// y / *yscale for write_static, made once a thread: a scale that is not finite or not above 0
// gives NaN quotients, so NaN codes.
__device__ __forceinline__ ClReciprocal static_divide(const float* __restrict__ yscale) {
  float scale = *yscale;
  const bool usable = scale > 0.0f && scale < __uint_as_float(0x7f800000u);  // finite, > 0
  if (!usable) scale = __uint_as_float(0x7fc00000u);
  return ClReciprocal{ClDivisor(scale)};
}

// write_quantized's rows under a static scale (divide: static_divide's): each vector's codes
// stored as computed, with no row amax to wait for, tested for NaN one pair at a time only in
// a vector that holds a NaN y or under an unusable (NaN) scale; returns this thread's largest
// |y| (fwd_rows reduces it once, at the end).
template <bool HELD, int VEC, int NPT, typename W, typename C, typename R, typename H>
__device__ __forceinline__ float write_static(const R (&p)[NPT], int N, C mu, C rstd,
                                              const W* __restrict__ gamma,
                                              const W* __restrict__ beta, const H (&hg)[NPT],
                                              const H (&hb)[NPT], cl_i64 row,
                                              unsigned char* __restrict__ yq,
                                              const ClReciprocal& divide, bool e5m2) {
  float m = 0.0f;
  const float scale_nan = divide(0.0f);  // NaN exactly where the scale is
  auto store = [&](auto e5m2_) {
    constexpr bool E5M2 = decltype(e5m2_)::value;
    chunk_outputs<HELD, VEC, NPT, false>(
        p, 0, N, mu, rstd, gamma, beta, hg, hb, [&](int, int col, const C (&o)[VEC]) {
          float y[VEC], n = scale_nan;
#pragma unroll
          for (int j = 0; j < VEC; ++j) {
            y[j] = (float)o[j];
            m = fmaxf(m, fabsf(y[j]));
            n = cl_max_nan(n, y[j]);
          }
          auto* q = reinterpret_cast<typename Float8Vec<VEC>::type*>(yq + row * N + col);
          if (n == n) *q = float8_pack<E5M2, false>(y, divide);
          else *q = float8_pack<E5M2, true>(y, divide);
        });
  };
  if (e5m2) store(BoolC<true>());
  else store(BoolC<false>());
  return m;
}

// The quantized forward's output of a row of one chunk (QUANT in fwd_rows): the chunk's y in
// float32 (as the reference rounds it), kept in dynamic shared memory (NPT vectors a thread:
// the host gives blockDim.x * blockDim.y * NPT * VEC floats), the row's amax (ClMax over its
// threads; every thread of the block calls, `valid` or not), then y / scale in float8
// (float8_pack) from what the thread kept: x, gamma and beta are not needed past the amax
// pass (fewer registers), and y is not computed twice. The scale, each row's amax / fmax (1
// where 0), is stored to qscale[row]; qflags bit 0: float8_e5m2 (else e4m3fn).
template <bool HELD, int VEC, int NPT, int WARP, int NORM, typename W, typename C, typename R,
          typename H>
__device__ __forceinline__ void write_quantized(const R (&p)[NPT], int N, C mu, C rstd,
                                                const W* __restrict__ gamma,
                                                const W* __restrict__ beta, const H (&hg)[NPT],
                                                const H (&hb)[NPT], bool valid, cl_i64 row,
                                                unsigned char* __restrict__ yq,
                                                float* __restrict__ qscale, int qflags,
                                                int phase) {
  // This thread's largest |y| and, where flagged (quant_flagged), whether one of its y is NaN
  // (one more instruction an element): only then are its codes tested for NaN one pair at a
  // time; the other kernels test every pair.
  constexpr bool FLAGGED = quant_flagged(NORM, VEC, sizeof(W));
  typedef Pack<float, VEC> Y;
  extern __shared__ __align__(16) unsigned char cl_smem[];
  const int threads = blockDim.x * blockDim.y;
  Y* kept = reinterpret_cast<Y*>(cl_smem) + threadIdx.y * blockDim.x + threadIdx.x;
  require_dynamic_smem(threads * NPT * sizeof(Y));  // a launch with less traps
  float m[1] = {0.0f}, n = 0.0f;
  if (valid)
    chunk_outputs<HELD, VEC, NPT, false>(p, 0, N, mu, rstd, gamma, beta, hg, hb,
                                         [&](int k, int, const C (&o)[VEC]) {
                                           Y y;
#pragma unroll
                                           for (int j = 0; j < VEC; ++j) {
                                             y.v[j] = (float)o[j];
                                             m[0] = fmaxf(m[0], fabsf(y.v[j]));
                                             if (FLAGGED) n = cl_max_nan(n, y.v[j]);
                                           }
                                           kept[k * threads] = y;
                                         });
  bool nans = !FLAGGED || n != n;
  row_allreduce<WARP, 0, ClMax>(m, phase);
  if (!valid) return;
  const bool e5m2 = qflags & 1;
  const float scale = m[0] > 0.0f ? ClDivisor(e5m2 ? 57344.0f : 448.0f)(m[0]) : 1.0f;
  if (threadIdx.x == 0) qscale[row] = scale;
  // infinities over an infinite scale are NaN too
  nans = nans || !(m[0] < __uint_as_float(0x7f800000u));
  // the format is chosen once, not per element
  auto store = [&](auto e5m2_, auto nans_) {
    const ClReciprocal divide{ClDivisor(scale)};
#pragma unroll
    for (int k = 0; k < NPT; ++k) {
      const int col = (k * (int)blockDim.x + (int)threadIdx.x) * VEC;
      if (col < N)
        *reinterpret_cast<typename Float8Vec<VEC>::type*>(yq + row * N + col) =
            float8_pack<decltype(e5m2_)::value, decltype(nans_)::value>(kept[k * threads].v,
                                                                         divide);
    }
  };
  if (nans) {
    if (e5m2) store(BoolC<true>(), BoolC<true>());
    else store(BoolC<false>(), BoolC<true>());
  } else {
    if (e5m2) store(BoolC<true>(), BoolC<false>());
    else store(BoolC<false>(), BoolC<false>());
  }
}

// Rows of one chunk (CHUNKED = false: the row stays in registers, packed as loaded, and x is
// read once) or of many (CHUNKED = true: statistics over all chunks, then each chunk read again
// for the output). FULL (the planner's choice where N is a multiple of the chunk, direct rows of
// one chunk): every thread's vectors lie below N, so the loads, the centred pass and the stores
// test no column (fewer instructions and registers).
// ADD: the fused residual add. The row is h = x + res (ldr: res's row stride), stored to hout
// (rows of N) in H and normalized as stored; chunked rows read h back for the output.
// CL > 1: each row split over the CL blocks of a cluster (gridDim.y == CL, one row per block at
// a time): a chunk spans the cluster, block r holding its part r, and the chunk's sums are added
// through distributed shared memory.
// QUANT (cln::row_scales, cln::tensor_scale): y in float8 bits, rows of one chunk only; scaled
// per row (write_quantized, qscale and qflags as there) or by the static scale *yscale
// (write_static), the largest |y| of all rows then going to *qamax (zeroed by the host) by one
// atomic max per block, after the last row.
template <typename T, bool QUANT> struct YOut { typedef T type; };
template <typename T> struct YOut<T, true> { typedef unsigned char type; };
template <bool CHUNKED, bool STAGE, bool EARLY_PARAMS, typename T, typename W, int VEC,
          int NPT, int WARP, bool FULL = false, typename H = T, bool ADD = false, int CL = 1,
          int QUANT = 0, int NORM = cln::either_norm>
__device__ __forceinline__ void fwd_rows(const T* __restrict__ x, cl_i64 ldx,
                                         const W* __restrict__ gamma, const W* __restrict__ beta,
                                         typename YOut<T, QUANT != 0>::type* __restrict__ y,
                                         float* __restrict__ mean_out,
                                         float* __restrict__ rstd_out, cl_i64 M, cl_i64 N,
                                         typename Acc<T>::type eps,
                                         const H* __restrict__ res = nullptr, cl_i64 ldr = 0,
                                         H* __restrict__ hout = nullptr,
                                         float* __restrict__ qscale = nullptr,
                                         const float* __restrict__ yscale = nullptr,
                                         float* __restrict__ qamax = nullptr, int qflags = 0) {
  static_assert(!ADD || !(STAGE || EARLY_PARAMS || FULL), "fused add: direct rows only");
  static_assert(CL == 1 || !EARLY_PARAMS, "clusters: parameters late");
  static_assert(!QUANT || (!CHUNKED && CL == 1 && !FULL), "float8 y: rows of one chunk");
  typedef typename Acc<T>::type C;
  const bool ln = is_ln<NORM>(mean_out);
  if constexpr (CL > 1) cluster_rows_init<CL, WARP, cluster_slots<CL, WARP, 1024>(), 1, C>();
  const cl_i64 chunk = (cl_i64)blockDim.x * NPT * VEC;  // one block's part of a chunk
  const cl_i64 span = CL * chunk;
  const cl_i64 tile = CL > 1 ? (cl_i64)blockIdx.y * chunk : 0;  // this block's, in the chunk
  const int nchunks = CHUNKED ? (int)((N + span - 1) / span) : 1;
  const C inv_n = cl_inv_count(C(0), N);
  const cl_i64 step = (cl_i64)gridDim.x * blockDim.y;
  typename RowVec<H, VEC>::type p[NPT];
  // One vector per thread (the planner's choice for small M), or EARLY_PARAMS (its choice for
  // 4-byte and wider types; fwd.early in cupyln/_config.py): gamma/beta are read right after the
  // row, so the three loads are in flight together, instead of after the row's reductions.
  // (Loaded once before the loop, their conversions were hoisted above the row's load and waited
  // for them: two memory trips in a row, in the SASS.)
  constexpr bool EARLY = !CHUNKED && (NPT == 1 || EARLY_PARAMS);
  typename Held<W, VEC>::type hg[NPT], hb[NPT];
  // Staged rows (stage_packs): two buffers of [NPT][threads] packs of x in dynamic shared
  // memory, given by the host (cupyln/_plan.py); a launch with less traps. Each thread reads back
  // only the slots it copied, so no barrier is added.
  typedef Pack<T, VEC> P;
  constexpr bool STAGED = STAGE && !CHUNKED && CLN_ASYNC_COPY && sizeof(P) >= 4;
  extern __shared__ __align__(16) unsigned char cl_smem[];
  P* stage = reinterpret_cast<P*>(cl_smem);
  const int threads = blockDim.x * blockDim.y;
  const int tid = threadIdx.y * blockDim.x + threadIdx.x;
  auto prefetch = [&](cl_i64 row, int b) {
    if constexpr (STAGED) {
      const bool ok = row < M;
      stage_packs<VEC, NPT>(stage + b * NPT * threads, x + (ok ? row : 0) * ldx, tile, N, ok);
      async_commit();
    }
  };
  if constexpr (STAGED) require_dynamic_smem(2u * NPT * threads * sizeof(P));
  prefetch((cl_i64)blockIdx.x * blockDim.y + threadIdx.y, 0);
  int phase = 0;
  float amax = 0.0f;  // a static scale's: the largest |y| of this thread's rows
  ClReciprocal divide{};
  if constexpr (QUANT == cln::tensor_scale) divide = static_divide(yscale);
  // Every thread of the block runs the same number of iterations (the reductions need all).
  for (cl_i64 base = (cl_i64)blockIdx.x * blockDim.y; base < M; base += step) {
    const cl_i64 row = base + threadIdx.y;
    const bool valid = row < M;
    const T* xr = x + (valid ? row : 0) * ldx;
    C n = C(0), mean = C(0), m2 = C(0);
    for (int c = 0; c < nchunks; ++c, ++phase) {
      const cl_i64 t0 = c * span + tile;
      if constexpr (STAGED) {  // one chunk: phase counts rows
        prefetch(row + step, (phase + 1) & 1);
        async_wait<1>();  // this row's copies have landed; the next row's stay in flight
        const P* src = stage + (phase & 1) * NPT * threads + tid;
#pragma unroll
        for (int k = 0; k < NPT; ++k) to_row(src[k * threads], p[k]);
      } else if constexpr (ADD) {
        load_row_add<VEC, NPT>(xr, res + (valid ? row : 0) * ldr, hout + row * N, t0, N, valid,
                               p);
      } else {
        load_row<VEC, NPT, FULL>(xr, t0, N, valid, p);
      }
      if (EARLY) {  // predicated, not branched: a branch let a conversion of x wait before it
        load_packs<VEC, NPT, FULL>(gamma, tile, N, gamma != nullptr, hg);
        load_packs<VEC, NPT, FULL>(beta, tile, N, beta != nullptr, hb);
      }
      chunk_stats<CHUNKED, WARP, VEC, NPT, FULL, 0, CL>(ln, p, c * span, t0, N, span, phase,
                                                            inv_n, n, mean, m2);
    }
    const C mu = ln ? mean : C(0);
    const C rstd = cl_rsqrt(m2 * inv_n + eps);
    if (valid && threadIdx.x == 0) {
      if (ln) mean_out[row] = (float)mu;
      rstd_out[row] = (float)rstd;
    }
    if constexpr (QUANT == cln::tensor_scale) {
      if (valid)
        amax = fmaxf(amax, write_static<EARLY, VEC, NPT>(p, (int)N, mu, rstd, gamma, beta, hg,
                                                         hb, row, y, divide, qflags & 1));
    } else if constexpr (QUANT == cln::row_scales) {
      write_quantized<EARLY, VEC, NPT, WARP, NORM>(p, (int)N, mu, rstd, gamma, beta, hg, hb,
                                                   valid, row, y, qscale, qflags, phase);
    } else {
      for (int c = 0; c < nchunks && valid; ++c) {
        const cl_i64 t0 = c * span + tile;
        if constexpr (CHUNKED && ADD) {  // read again: h, as this thread stored it
          load_row<VEC, NPT>(hout + row * N, t0, N, valid, p);
        } else if constexpr (CHUNKED) {
          load_row<VEC, NPT>(xr, t0, N, valid, p);
        }
        write_chunk<EARLY, VEC, NPT, FULL>(p, (int)t0, (int)N, mu, rstd, gamma, beta,
                                          y + row * N, hg, hb);
      }
    }
  }
  if constexpr (QUANT == cln::tensor_scale) {  // non-negative floats order as their bits do
    // one atomic a block, not one a row of threads: many on one address queued at the end
    __shared__ int block_amax;
    float a[1] = {amax};
    row_allreduce<WARP, 0, ClMax>(a, phase);
    const bool first = threadIdx.x == 0 && threadIdx.y == 0;
    if (first) block_amax = 0;
    __syncthreads();
    if (threadIdx.x == 0 && a[0] > 0.0f) atomicMax(&block_amax, __float_as_int(a[0]));
    __syncthreads();
    if (first && block_amax > 0) atomicMax(reinterpret_cast<int*>(qamax), block_amax);
  }
  async_wait<0>();  // the copies past the last row (zero fills) land before the block exits
  // a cluster's blocks leave together: none exits while its sums may still be on their way
  if constexpr (CL > 1) cluster_sync();
}

#define CLN_FWD_PARAMS                                                                        \
  const T *__restrict__ x, cl_i64 ldx, const W *__restrict__ gamma, const W *__restrict__ beta, \
      T *__restrict__ y, float *__restrict__ mean_out, float *__restrict__ rstd_out, cl_i64 M, \
      cl_i64 N, typename Acc<T>::type eps
#define CLN_FWD_ARGS x, ldx, gamma, beta, y, mean_out, rstd_out, M, N, eps

// NORM: fixed for early parameters (the host's rule; a single row's latency grew with the branch).
template <typename T, typename W, int VEC, int NPT, int WARP, bool STAGE, bool EARLY,
          bool FULL, int NORM = cln::either_norm>
__global__ void __launch_bounds__(1024) norm_fwd(CLN_FWD_PARAMS) {
  fwd_rows<false, STAGE, EARLY, T, W, VEC, NPT, WARP, FULL, T, false, 1, false, NORM>(
      CLN_FWD_ARGS);
}

// Rows longer than one chunk: 4 vectors per thread (the planner's choice for long rows).
template <typename T, typename W, int VEC, int WARP>
__global__ void __launch_bounds__(1024) norm_fwd_chunked(CLN_FWD_PARAMS) {
  fwd_rows<true, false, false, T, W, VEC, 4, WARP>(CLN_FWD_ARGS);
}

// y of a peeled row's vectors held in p (from column head + c0 of the middle's `mid` elements)
// and, where has_e, of its element ex at column ec; gamma and beta read per element (as
// write_chunk's one path: an absent gamma taken as 1, an absent beta as -0).
template <int VEC, int NPT, typename R, typename T, typename W, typename C>
__device__ __forceinline__ void write_peeled(const R (&p)[NPT], cl_i64 c0, cl_i64 mid, int head,
                                             C ex, cl_i64 ec, bool has_e, C mu, C rstd,
                                             const W* __restrict__ gamma,
                                             const W* __restrict__ beta, T* __restrict__ yr) {
  auto norm = [&](C v, cl_i64 c) {
    const C scale = rstd * (gamma ? to_acc(gamma[c]) : C(1));
    return cl_fma(v - mu, scale, beta ? to_acc(beta[c]) : C(-0.0));
  };
#pragma unroll
  for (int k = 0; k < NPT; ++k) {
    const cl_i64 col = c0 + ((cl_i64)k * blockDim.x + threadIdx.x) * VEC;
    if (col >= mid) continue;
    C o[VEC];
#pragma unroll
    for (int j = 0; j < VEC; ++j) o[j] = norm((C)elem(p[k], j), head + col + j);
    store_vec<VEC>(yr + head + col, o);
  }
  if (has_e) yr[ec] = Store<T>::cvt(norm(ex, ec));
}

// A peeled row's element ec where has_e (else 0): x's, or (ADD: rr and hr the row's residual
// and h) h = x + residual, stored to hr as load_row_add stores the vectors.
template <bool ADD, typename T>
__device__ __forceinline__ typename Acc<T>::type peeled_elem(const T* __restrict__ xr,
                                                             const T* __restrict__ rr,
                                                             T* __restrict__ hr, cl_i64 ec,
                                                             bool has_e) {
  typedef typename Acc<T>::type C;
  if constexpr (ADD) return has_e ? add_elem(xr[ec], rr[ec], hr + ec) : C(0);
  return has_e ? to_acc(xr[ec]) : C(0);
}

// A peeled row's vectors as norm_fwd_peeled keeps them: float16 packed at 8 vectors per thread,
// whose 64 floats alone are the launch bound's registers (ptxas: 420 bytes spilled, 58 packed).
template <typename T, int VEC, int NPT> struct PeeledVec {
  typedef typename RowVec<T, VEC>::type type;
};
template <int VEC> struct PeeledVec<cl_half, VEC, 8> { typedef Pack<cl_half, VEC> type; };

// Rows on which 16-byte vectors do not fit as they are (odd N, or a row stride that is not a
// multiple of the vector): each row's head (the elements before its first 16-byte boundary) and
// tail (after its last) are peeled off, one element per thread of the first 2 * VEC, and the
// middle streams in 16-byte vectors from that boundary, one chunk in registers (NPT vectors per
// thread). y's rows start at the same offset within 16 bytes as x's (the host's rule), so they
// peel alike; gamma and beta, aligned at column 0, are read per element (from L1). blockDim.x
// >= 2 * VEC, N >= 2 * VEC. EARLY (one vector per thread; the planner's choice for rows too few
// to fill the GPU, which wait on every memory trip): gamma and beta read with the row, in flight
// during its reductions, not after them. STAGE (several vectors per thread; the planner's choice
// where the rows outnumber the resident blocks): the resident blocks loop over rows, the next
// row's middle copied ahead (cp.async) into one of two buffers of [NPT][threads] packs in
// dynamic shared memory, so that its loads overlap this row's reductions and stores; each pass
// reads the row from its buffer (SmemRow), no registers held for it.
// ADD: the fused residual add, h in T (res's and h's rows start alike with x's within 16 bytes,
// the host's rule): each row's h = x + res stored and normalized as stored, never staged.
template <typename T, typename W, int NPT, int WARP, bool EARLY, bool STAGE, bool ADD>
__device__ __forceinline__ void fwd_peeled_rows(CLN_FWD_PARAMS, const T* __restrict__ res,
                                                cl_i64 ldr, T* __restrict__ hout) {
  static_assert(!EARLY || NPT == 1, "early parameters: one vector per thread");
  static_assert(!(ADD && STAGE), "the fused add: rows never staged");
  typedef typename Acc<T>::type C;
  const bool ln = is_ln<cln::either_norm>(mean_out);
  constexpr int VEC = 16 / (int)sizeof(T);
  const C inv_n = cl_inv_count(C(0), N);
  const cl_i64 step = (cl_i64)gridDim.x * blockDim.y;
  const int t = threadIdx.x;
  typename PeeledVec<T, VEC, NPT>::type p[NPT];
  typedef Pack<T, VEC> P;
  constexpr bool STAGED = STAGE && CLN_ASYNC_COPY;
  extern __shared__ __align__(16) unsigned char cl_smem[];
  P* stage = reinterpret_cast<P*>(cl_smem);
  const int threads = blockDim.x * blockDim.y;
  auto prefetch = [&](cl_i64 row, int b) {  // the middle of `row` into buffer b
    if constexpr (STAGED) {
      const bool ok = row < M;
      const T* r = x + (ok ? row : 0) * ldx;
      const int h = peel_head(r);
      stage_packs<VEC, NPT>(stage + b * NPT * threads, r + h, 0, (N - h) / VEC * VEC, ok);
      async_commit();
    }
  };
  if constexpr (STAGED) require_dynamic_smem(2u * NPT * threads * sizeof(P));
  prefetch((cl_i64)blockIdx.x * blockDim.y + threadIdx.y, 0);
  int phase = 0;
  for (cl_i64 base = (cl_i64)blockIdx.x * blockDim.y; base < M; base += step, ++phase) {
    const cl_i64 row = base + threadIdx.y;
    const bool valid = row < M;
    const T* xr = x + (valid ? row : 0) * ldx;
    const int head = peel_head(xr);
    const cl_i64 mid = (N - head) / VEC * VEC;  // the middle's elements, from column head
    // this thread's peeled element: head element t, or tail element t - VEC
    const cl_i64 ec = t < VEC ? t : head + mid + (t - VEC);
    const bool has_e = valid && (t < VEC ? t < head : t < 2 * VEC && ec < N);
    const T* rr = ADD ? res + (valid ? row : 0) * ldr : nullptr;  // the row's residual and h
    T* hr = ADD ? hout + row * N : nullptr;
    const C ex = peeled_elem<ADD>(xr, rr, hr, ec, has_e);
    // STAGED: the row's packs stay in shared memory, read by each pass (this thread's slots)
    const SmemRow<P> sp{stage + (phase & 1) * NPT * threads + threadIdx.y * blockDim.x + t,
                        threads};
    if constexpr (ADD) {
      load_row_add<VEC, NPT>(xr + head, rr + head, hr + head, 0, mid, valid, p);
    } else if constexpr (STAGED) {
      prefetch(row + step, (phase + 1) & 1);
      async_wait<1>();  // this row's copies have landed; the next row's stay in flight
    } else {
      load_row<VEC, NPT>(xr + head, 0, mid, valid, p);
    }
    // EARLY: this thread's gamma and beta, its vector's elements then its peeled element's
    C eg[EARLY ? VEC + 1 : 1], eb[EARLY ? VEC + 1 : 1];
    if constexpr (EARLY) {
      const cl_i64 col = (cl_i64)t * VEC;
#pragma unroll
      for (int j = 0; j <= VEC; ++j) {
        const bool ok = j < VEC ? valid && col < mid : has_e;
        const cl_i64 c = j < VEC ? head + col + j : ec;
        eg[j] = gamma && ok ? to_acc(gamma[c]) : C(1);
        eb[j] = beta && ok ? to_acc(beta[c]) : C(-0.0);
      }
    }
    C n = C(0), mean = C(0), m2 = C(0);
    if constexpr (STAGED)
      chunk_stats<false, WARP, VEC, NPT, false, 0, 1, true>(ln, sp, 0, 0, mid, mid, phase, inv_n,
                                                                 n, mean, m2, ex, has_e);
    else
      chunk_stats<false, WARP, VEC, NPT, false, 0, 1, true>(ln, p, 0, 0, mid, mid, phase, inv_n,
                                                                 n, mean, m2, ex, has_e);
    const C mu = ln ? mean : C(0);
    const C rstd = cl_rsqrt(m2 * inv_n + eps);
    if (!valid) continue;
    if (t == 0) {
      if (ln) mean_out[row] = (float)mu;
      rstd_out[row] = (float)rstd;
    }
    // write_peeled's loop, written out: through the helper this kernel compiles to other PTX,
    // and a shared store helper had moved its registers and lost up to 12% (NOTES)
    auto norm = [&](C v, cl_i64 c, int j) {  // j: the element's place in eg / eb (EARLY)
      if constexpr (EARLY) return cl_fma(v - mu, rstd * eg[j], eb[j]);
      const C scale = rstd * (gamma ? to_acc(gamma[c]) : C(1));
      return cl_fma(v - mu, scale, beta ? to_acc(beta[c]) : C(-0.0));
    };
    T* yr = y + row * N;
#pragma unroll
    for (int k = 0; k < NPT; ++k) {
      const cl_i64 col = ((cl_i64)k * blockDim.x + t) * VEC;
      if (col >= mid) continue;
      C o[VEC];
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const C v = STAGED ? (C)elem(sp[k], j) : (C)elem(p[k], j);
        o[j] = norm(v, head + col + j, j);
      }
      store_vec<VEC>(yr + head + col, o);
    }
    if (has_e) yr[ec] = Store<T>::cvt(norm(ex, ec, VEC));
  }
  // the copies past the last row (zero fills) land before the block exits
  if constexpr (STAGED) async_wait<0>();
}

template <typename T, typename W, int NPT, int WARP, bool EARLY = false,
          bool STAGE = false>
__global__ void __launch_bounds__(1024) norm_fwd_peeled(CLN_FWD_PARAMS) {
  fwd_peeled_rows<T, W, NPT, WARP, EARLY, STAGE, false>(CLN_FWD_ARGS, nullptr, 0, nullptr);
}

template <typename T, typename W, int NPT, int WARP, bool EARLY = false>
__global__ void __launch_bounds__(1024)
norm_fwd_peeled_add(CLN_FWD_PARAMS, const T* __restrict__ res, cl_i64 ldr,
                    T* __restrict__ hout) {
  fwd_peeled_rows<T, W, NPT, WARP, EARLY, false, true>(CLN_FWD_ARGS, res, ldr, hout);
}

// Peeled rows longer than one block of 8 vectors per thread, more of them than parts over the
// grid take (the planner's choice where single elements would otherwise run the whole row): each
// row's head and tail peeled as norm_fwd_peeled's, its middle read in chunks of NPT 16-byte
// vectors per thread twice, as norm_fwd_chunked reads rows whose vectors fit: each chunk's
// statistics (chunk 0's with the peeled elements) merged by Chan's formula, then y (the second
// read mostly from L2). One row per block; blockDim.x >= 2 * VEC. ADD: as fwd_peeled_rows', the
// second read of h as this thread stored it.
template <typename T, typename W, int WARP, bool ADD>
__device__ __forceinline__ void fwd_peeled_chunks(CLN_FWD_PARAMS, const T* __restrict__ res,
                                                  cl_i64 ldr, T* __restrict__ hout) {
  typedef typename Acc<T>::type C;
  const bool ln = is_ln<cln::either_norm>(mean_out);
  constexpr int VEC = 16 / (int)sizeof(T), NPT = 4;
  const int t = threadIdx.x;
  const cl_i64 chunk = (cl_i64)blockDim.x * NPT * VEC;
  const C inv_n = cl_inv_count(C(0), N);
  typename RowVec<T, VEC>::type p[NPT];
  int phase = 0;
  for (cl_i64 row = blockIdx.x; row < M; row += gridDim.x) {
    const T* xr = x + row * ldx;
    const int head = peel_head(xr);
    const cl_i64 mid = (N - head) / VEC * VEC;  // the middle's elements, from column head
    const cl_i64 ec = t < VEC ? t : head + mid + (t - VEC);  // as norm_fwd_peeled's
    const bool has_e = t < VEC ? t < head : t < 2 * VEC && ec < N;
    const T* rr = ADD ? res + row * ldr : nullptr;  // the row's residual and h
    T* hr = ADD ? hout + row * N : nullptr;
    const C ex = peeled_elem<ADD>(xr, rr, hr, ec, has_e);
    const int chunks = (int)((mid + chunk - 1) / chunk);
    C n = C(0), mean = C(0), m2 = C(0);
    for (int c = 0; c < chunks; ++c, ++phase) {
      const cl_i64 c0 = c * chunk, left = mid - c0;
      const C cnt = (C)((left < chunk ? left : chunk) + (c == 0 ? N - mid : 0));
      if constexpr (ADD)
        load_row_add<VEC, NPT>(xr + head, rr + head, hr + head, c0, mid, true, p);
      else
        load_row<VEC, NPT>(xr + head, c0, mid, true, p);
      C cn = C(0), cmean = C(0), cm2 = C(0);
      chunk_stats<false, WARP, VEC, NPT, false, 0, 1, true>(ln, 
          p, c0, c0, mid, chunk, phase, C(1) / cnt, cn, cmean, cm2, ex, has_e && c == 0);
      if (ln) chan_merge(n, mean, m2, cnt, cmean, cm2);
      else m2 += cm2;
    }
    const C mu = ln ? mean : C(0);
    const C rstd = cl_rsqrt(m2 * inv_n + eps);
    if (t == 0) {
      if (ln) mean_out[row] = (float)mu;
      rstd_out[row] = (float)rstd;
    }
    const T* back = ADD ? hr : xr;  // h, as this thread stored it
    for (int c = 0; c < chunks; ++c) {
      load_row<VEC, NPT>(back + head, c * chunk, mid, true, p);
      write_peeled<VEC, NPT>(p, c * chunk, mid, head, ex, ec, has_e && c == 0, mu, rstd, gamma,
                             beta, y + row * N);
    }
  }
}

template <typename T, typename W, int WARP>
__global__ void __launch_bounds__(1024) norm_fwd_peeled_chunked(CLN_FWD_PARAMS) {
  fwd_peeled_chunks<T, W, WARP, false>(CLN_FWD_ARGS, nullptr, 0, nullptr);
}

template <typename T, typename W, int WARP>
__global__ void __launch_bounds__(1024)
norm_fwd_peeled_add_chunked(CLN_FWD_PARAMS, const T* __restrict__ res, cl_i64 ldr,
                            T* __restrict__ hout) {
  fwd_peeled_chunks<T, W, WARP, true>(CLN_FWD_ARGS, res, ldr, hout);
}

// Peeled rows longer than one block split over the CL blocks of a cluster (sm_90; with the
// planner's fwd_peel_cluster row, where one chunk of the cluster holds the row's middle): x read
// once, as norm_fwd_cluster's rows, where norm_fwd_peeled_chunked reads it twice. The middle's
// vectors span the cluster (block r holding its part r); the first block's first 2 * VEC
// threads also take the head and tail, one element each. One row per cluster at a time, gamma and beta read
// per element at the output.
template <typename T, typename W, int NPT, int WARP, int CL>
__global__ void __launch_bounds__(1024)
CLN_CLUSTER_DIMS(1, CL, 1) norm_fwd_peeled_cluster(CLN_FWD_PARAMS) {
#if CLN_CLUSTERS
  typedef typename Acc<T>::type C;
  const bool ln = is_ln<cln::either_norm>(mean_out);
  constexpr int VEC = 16 / (int)sizeof(T);
  cluster_rows_init<CL, WARP, cluster_slots<CL, WARP, 1024>(), 1, C>();
  const int t = threadIdx.x;
  const cl_i64 chunk = (cl_i64)blockDim.x * NPT * VEC, tile = (cl_i64)blockIdx.y * chunk;
  if (blockDim.y != 1 || CL * chunk < N / VEC * VEC || blockDim.x < 2 * VEC) cl_trap();
  const bool edges = blockIdx.y == 0;  // the block that takes the head and tail
  const C inv_n = cl_inv_count(C(0), N);
  typename RowVec<T, VEC>::type p[NPT];
  int phase = 0;
  for (cl_i64 row = blockIdx.x; row < M; row += gridDim.x, ++phase) {
    const T* xr = x + row * ldx;
    const int head = peel_head(xr);
    const cl_i64 mid = (N - head) / VEC * VEC;  // the middle's elements, from column head
    const cl_i64 ec = t < VEC ? t : head + mid + (t - VEC);  // as norm_fwd_peeled's
    const bool has_e = edges && (t < VEC ? t < head : t < 2 * VEC && ec < N);
    const C ex = peeled_elem<false, T>(xr, nullptr, nullptr, ec, has_e);
    load_row<VEC, NPT>(xr + head, tile, mid, true, p);
    C n = C(0), mean = C(0), m2 = C(0);
    chunk_stats<false, WARP, VEC, NPT, false, 0, CL, true>(ln, 
        p, 0, tile, mid, CL * chunk, phase, inv_n, n, mean, m2, ex, has_e);
    const C mu = ln ? mean : C(0);
    const C rstd = cl_rsqrt(m2 * inv_n + eps);
    if (edges && t == 0) {
      if (ln) mean_out[row] = (float)mu;
      rstd_out[row] = (float)rstd;
    }
    write_peeled<VEC, NPT>(p, tile, mid, head, ex, ec, has_e, mu, rstd, gamma, beta, y + row * N);
  }
  cluster_sync();  // none of the cluster's blocks exits while its sums may be on their way
#else
  cl_trap();  // the planner launches it only where clusters exist
#endif
}

// The fused residual add (fwd_rows' ADD), h in H: rows of one chunk, NPT vectors per thread,
// and longer rows in chunks. Built for 16-byte vectors and single elements only (the planner's
// rule): intermediate widths would double the specializations for rare alignments.
#define CLN_FWD_ADD_PARAMS \
  CLN_FWD_PARAMS, const H *__restrict__ res, cl_i64 ldr, H *__restrict__ hout
template <typename T, typename W, typename H, int VEC, int NPT, int WARP>
__global__ void __launch_bounds__(1024) norm_fwd_add(CLN_FWD_ADD_PARAMS) {
  fwd_rows<false, false, false, T, W, VEC, NPT, WARP, false, H, true>(CLN_FWD_ARGS, res, ldr,
                                                                          hout);
}

// y in float8 (fwd_rows' QUANT: scaled per row or by one static scale), of the plain rows or
// of the fused add's: rows of one chunk, 16-byte vectors or single elements (the planner's
// rule, as the fused add's). qflags: float8_e5m2 (else e4m3fn).
#define CLN_FWD_Q_PARAMS                                                                      \
  const T *__restrict__ x, cl_i64 ldx, const W *__restrict__ gamma, const W *__restrict__ beta, \
      unsigned char *__restrict__ y, float *__restrict__ mean_out, float *__restrict__ rstd_out, \
      cl_i64 M, cl_i64 N, typename Acc<T>::type eps, const H *__restrict__ res, cl_i64 ldr,     \
      H *__restrict__ hout, float *__restrict__ qscale, const float *__restrict__ yscale,       \
      float *__restrict__ qamax, cl_i64 qflags
template <typename T, typename W, typename H, int NORM, int VEC, int NPT, int WARP, bool ADD,
          int QUANT>
__global__ void __launch_bounds__(quant_max_threads(NORM, VEC, sizeof(W))) norm_fwd_q(CLN_FWD_Q_PARAMS) {
  fwd_rows<false, false, false, T, W, VEC, NPT, WARP, false, H, ADD, 1, QUANT, NORM>(
      CLN_FWD_ARGS, res, ldr, hout, qscale, yscale, qamax, (int)qflags);
}

template <typename T, typename W, typename H, int VEC, int WARP>
__global__ void __launch_bounds__(1024) norm_fwd_add_chunked(CLN_FWD_ADD_PARAMS) {
  fwd_rows<true, false, false, T, W, VEC, 4, WARP, false, H, true>(CLN_FWD_ARGS, res, ldr,
                                                                       hout);
}

// Rows split over the CL blocks of a cluster (sm_90; the planner's choice for rows longer than
// one block holds and that the cluster's registers hold): x read once. (CHUNKED, chunks spanning
// the cluster, read twice, is not built: few rows past a cluster run in parts, norm_fwd_parts.)
// STAGE: resident clusters loop over rows, each block copying its part of the next row into
// shared memory while it reduces this one, so the exchanges' latency overlaps the loads. Built
// for 16-byte vectors, as the fused add's (norm_fwd_add_cluster, direct).
template <typename T, typename W, int VEC, int NPT, int WARP, int CL, bool CHUNKED,
          bool STAGE = false>
__global__ void __launch_bounds__(1024)
CLN_CLUSTER_DIMS(1, CL, 1) norm_fwd_cluster(CLN_FWD_PARAMS) {
  fwd_rows<CHUNKED, STAGE, false, T, W, VEC, NPT, WARP, false, T, false, CL>(CLN_FWD_ARGS);
}

template <typename T, typename W, typename H, int VEC, int NPT, int WARP, int CL,
          bool CHUNKED>
__global__ void __launch_bounds__(1024)
CLN_CLUSTER_DIMS(1, CL, 1) norm_fwd_add_cluster(CLN_FWD_ADD_PARAMS) {
  fwd_rows<CHUNKED, false, false, T, W, VEC, NPT, WARP, false, H, true, CL>(CLN_FWD_ARGS, res,
                                                                              ldr, hout);
}

// A thread's vectors of one row in a ring of `slots` slots of shared memory (`stride` packs
// apart), the row's vector k in slot (first + k) mod slots.
template <typename P> struct RingRow {
  const P* base;
  int first, slots, stride;
  __device__ __forceinline__ int slot(int k) const {
    const int s = first + k;
    return s < slots ? s : s - slots;
  }
  __device__ __forceinline__ P operator[](int k) const { return base[slot(k) * stride]; }
};

// Rows split over the CL blocks of a cluster and held in their shared memory (sm_90; the
// planner's choice for rows longer than one chunk of 8 blocks' registers, at least two per
// resident cluster): x read once, the resident clusters looping over rows. Each
// thread keeps its NPT vectors of a row in a ring of `slots` slots (as many as the launch's
// dynamic shared memory holds, at most 2 * NPT): the next row's first slots - NPT vectors are
// copied (cp.async) into the free slots before this row's reductions, and each later one into
// the slot of this row's vector just written out, so that the next row streams in while this
// one is reduced and written even where two rows do not fit. Each thread reads only the slots
// it copied into: no barrier.
template <typename T, typename W, int NPT, int WARP, int CL>
__global__ void __launch_bounds__(1024)
CLN_CLUSTER_DIMS(1, CL, 1) norm_fwd_resident(CLN_FWD_PARAMS) {
#if CLN_CLUSTERS && CLN_ASYNC_COPY
  typedef typename Acc<T>::type C;
  const bool ln = is_ln<cln::either_norm>(mean_out);
  constexpr int VEC = 16 / (int)sizeof(T);
  typedef Pack<T, VEC> P;
  cluster_rows_init<CL, WARP, cluster_slots<CL, WARP, 1024>(), 1, C>();
  extern __shared__ __align__(16) unsigned char cl_smem[];
  const P* ring = reinterpret_cast<const P*>(cl_smem) + threadIdx.x;
  const int slots = min((int)(dynamic_smem_bytes() / (blockDim.x * sizeof(P))), 2 * NPT);
  if (slots < NPT) cl_trap();  // a host/kernel mismatch: the row would not fit
  const int early = slots - NPT;  // the next row's vectors copied before this row's reductions
  const cl_i64 chunk = (cl_i64)blockDim.x * NPT * VEC, tile = (cl_i64)blockIdx.y * chunk;
  const C inv_n = cl_inv_count(C(0), N);
  auto copy = [&](cl_i64 row, int k, int slot) {  // vector k of this block's part of `row`
    const cl_i64 col = tile + ((cl_i64)k * blockDim.x + threadIdx.x) * VEC;
    const bool ok = row < M && col < N;
    copy16_async(smem_addr(ring + slot * blockDim.x), x + (ok ? row * ldx + col : 0), ok);
  };
  cl_i64 row = blockIdx.x;
#pragma unroll
  for (int k = 0; k < NPT; ++k) copy(row, k, k);
  async_commit();
  typename Held<W, VEC>::type unused[1];
  int first = 0, phase = 0;
  for (; row < M; row += gridDim.x, ++phase) {
    async_wait<0>();  // this row's vectors have landed
    const RingRow<P> p{ring, first, slots, (int)blockDim.x};
    const int next_first = p.slot(NPT);
    for (int k = 0; k < early && k < NPT; ++k) copy(row + gridDim.x, k, p.slot(NPT + k));
    async_commit();
    C n = C(0), mean = C(0), m2 = C(0);
    chunk_stats<false, WARP, VEC, NPT, false, 0, CL>(ln, p, 0, tile, N, CL * chunk, phase,
                                                         inv_n, n, mean, m2);
    const C mu = ln ? mean : C(0);
    const C rstd = cl_rsqrt(m2 * inv_n + eps);
    if (blockIdx.y == 0 && threadIdx.x == 0) {
      if (ln) mean_out[row] = (float)mu;
      rstd_out[row] = (float)rstd;
    }
#pragma unroll
    for (int k = 0; k < NPT; ++k) {
      const P v[1] = {p[k]};
      write_chunk<false, VEC, 1, false>(v, (int)(tile + (cl_i64)k * blockDim.x * VEC), (int)N,
                                        mu, rstd, gamma, beta, y + row * N, unused, unused);
      if (k + early < NPT) copy(row + gridDim.x, k + early, p.slot(k));  // its slot is free
    }
    async_commit();
    first = next_first;
  }
  async_wait<0>();  // the copies past the last row (zero fills) land before the block exits
  cluster_sync();   // none of the cluster's blocks exits while its sums may be on their way
#else
  cl_trap();  // the planner launches it only where clusters and cp.async exist
#endif
}

// The statistics of row `row` from its G parts' (mean, centred sum of squares; RMSNorm's sum
// of squares) in pr, count(i) elements in part i: every warp adds them in the same order (the
// same bits in every block); block 0 stores them.
template <int WARP, typename C, typename F>
__device__ __forceinline__ void merge_parts(const C* __restrict__ pr, int G, F count, C inv_n,
                                            C eps, cl_i64 row, float* __restrict__ mean_out,
                                            float* __restrict__ rstd_out, C& mu, C& rstd) {
  const bool ln = is_ln<cln::either_norm>(mean_out);
  const int lane = threadIdx.x % WARP;
  C s[1] = {C(0)};
  for (int i = lane; i < G; i += WARP) s[0] += ln ? count(i) * pr[2 * i] : pr[2 * i + 1];
  warp_allreduce<WARP>(s);
  mu = ln ? cl_mul(s[0], inv_n) : C(0);
  if (ln) {  // the centred sums moved to the row's mean (Chan's formula over all parts)
    C q[1] = {C(0)};
    for (int i = lane; i < G; i += WARP) {
      const C d = pr[2 * i] - mu;
      q[0] += pr[2 * i + 1] + count(i) * d * d;
    }
    warp_allreduce<WARP>(q);
    s[0] = q[0];
  }
  rstd = cl_rsqrt(s[0] * inv_n + eps);
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    if (ln) mean_out[row] = (float)mu;
    rstd_out[row] = (float)rstd;
  }
}

// One part of a peeled row (fwd_parts' PEEL; xr, yr and pr: the row's x, y and parts): the
// statistics of part blockIdx.x, as one chunk's, of its vectors (from column head + t0 of the
// middle) and, in part 0, of the head's and tail's elements; or (APPLY) the row's statistics
// from its parts and y of the part's elements, gamma and beta read per element. ADD (rr, hr:
// the row's residual and h, which start as x's within 16 bytes): the first launch stores h =
// x + residual, the second reads h back.
template <bool APPLY, int WARP, int VEC, int NPT, bool ADD, typename T, typename W,
          typename C>
__device__ __forceinline__ void peeled_parts(const T* __restrict__ xr,
                                             const W* __restrict__ gamma,
                                             const W* __restrict__ beta, T* __restrict__ yr,
                                             C* __restrict__ pr, cl_i64 N, C eps, cl_i64 row,
                                             float* __restrict__ mean_out,
                                             float* __restrict__ rstd_out,
                                             const T* __restrict__ rr, T* __restrict__ hr) {
  const bool ln = is_ln<cln::either_norm>(mean_out);
  const int t = threadIdx.x, G = gridDim.x;
  const cl_i64 chunk = (cl_i64)blockDim.x * NPT * VEC, t0 = (cl_i64)blockIdx.x * chunk;
  const int head = peel_head(xr);
  const cl_i64 mid = (N - head) / VEC * VEC;  // the middle's elements, from column head
  // elements of part i: its vectors', and part 0's the head's and tail's
  auto count = [&](int i) {
    const cl_i64 left = mid - i * chunk;
    return (C)((left < 0 ? 0 : left < chunk ? left : chunk) + (i == 0 ? N - mid : 0));
  };
  const cl_i64 ec = t < VEC ? t : head + mid + (t - VEC);
  const bool has_e = blockIdx.x == 0 && (t < VEC ? t < head : t < 2 * VEC && ec < N);
  constexpr bool STORES_H = ADD && !APPLY;
  const T* src = ADD && APPLY ? hr : xr;  // h as the first launch stored it
  const C ex = peeled_elem<STORES_H>(src, rr, hr, ec, has_e);
  typename RowVec<T, VEC>::type p[NPT];
  if constexpr (STORES_H)
    load_row_add<VEC, NPT>(xr + head, rr + head, hr + head, t0, mid, true, p);
  else
    load_row<VEC, NPT>(src + head, t0, mid, true, p);
  if constexpr (!APPLY) {
    const C cnt = count(blockIdx.x);
    C n = C(0), mean = C(0), m2 = C(0);
    chunk_stats<false, WARP, VEC, NPT, false, 0, 1, true>(ln, 
        p, t0, t0, mid, chunk, 0, cnt > C(0) ? C(1) / cnt : C(0), n, mean, m2, ex, has_e);
    if (t == 0) {
      pr[2 * blockIdx.x] = mean;
      pr[2 * blockIdx.x + 1] = m2;
    }
    return;
  }
  C mu, rstd;
  merge_parts<WARP>(pr, G, count, cl_inv_count(C(0), N), eps, row, mean_out, rstd_out, mu,
                        rstd);
  write_peeled<VEC, NPT>(p, t0, mid, head, ex, ec, has_e, mu, rstd, gamma, beta, yr);
}

// Few long rows split over the grid, in two launches (gridDim = (G parts per row, M), one chunk
// of blockDim.x * 4 vectors per block): APPLY = false writes each part's statistics (mean and
// centred sum of squares; RMSNorm's sum of squares) to part[row][G][2]; APPLY = true merges the
// row's G parts, every warp of every block in the same order (so the same bits), reads its
// chunk again (from L2 where the first launch just read it) and writes y. Every SM streams where
// a row per block or per cluster would leave most idle; any device. ADD: the fused residual
// add, h = x + res stored by the first launch (rows of N) and read back by the second. PEEL:
// rows peeled as norm_fwd_peeled's, the parts over the middle's 16-byte vectors (a part may have
// none), part 0's first 2 * VEC threads also taking the head and tail, one element each.
template <bool APPLY, typename T, typename W, int VEC, int WARP, typename H = T,
          bool ADD = false, bool PEEL = false>
__device__ __forceinline__ void fwd_parts(CLN_FWD_PARAMS, typename Acc<T>::type* __restrict__ part,
                                          const H* __restrict__ res = nullptr, cl_i64 ldr = 0,
                                          H* __restrict__ hout = nullptr) {
  typedef typename Acc<T>::type C;
  const bool ln = is_ln<cln::either_norm>(mean_out);
  constexpr int NPT = 4;
  static_assert(!PEEL || (VEC * sizeof(T) == 16 && (!ADD || sizeof(H) == sizeof(T))),
                "peeled: 16-byte vectors, h in x's dtype");
  const cl_i64 chunk = (cl_i64)blockDim.x * NPT * VEC, t0 = (cl_i64)blockIdx.x * chunk;
  const int G = gridDim.x;
  if constexpr (PEEL) {  // the parts cover the middle's vectors; part 0 the peeled elements
    if (blockDim.y != 1 || blockDim.x % WARP != 0 || (cl_i64)gridDim.y != M ||
        (cl_i64)G * chunk < N / VEC * VEC || blockDim.x < 2 * VEC)
      cl_trap();
    const cl_i64 row = blockIdx.y;
    peeled_parts<APPLY, WARP, VEC, NPT, ADD>(
        x + row * ldx, gamma, beta, y + row * N, part + row * G * 2, N, eps, row, mean_out,
        rstd_out, ADD ? (const T*)res + row * ldr : nullptr, ADD ? (T*)hout + row * N : nullptr);
    return;
  }
  if (blockDim.y != 1 || blockDim.x % WARP != 0 || (cl_i64)gridDim.y != M ||
      (cl_i64)G * chunk < N || t0 >= N)
    cl_trap();
  const cl_i64 row = blockIdx.y;
  typename RowVec<H, VEC>::type p[NPT];
  if constexpr (ADD && APPLY) {
    load_row<VEC, NPT>(hout + row * N, t0, N, true, p);  // h as the first launch stored it
  } else if constexpr (ADD) {
    load_row_add<VEC, NPT>(x + row * ldx, res + row * ldr, hout + row * N, t0, N, true, p);
  } else {
    load_row<VEC, NPT>(x + row * ldx, t0, N, true, p);
  }
  C* pr = part + row * G * 2;
  const C inv_n = cl_inv_count(C(0), N);
  if constexpr (!APPLY) {
    C n = C(0), mean = C(0), m2 = C(0);
    chunk_stats<true, WARP, VEC, NPT, false, 0, 1>(ln, p, t0, t0, N, chunk, 0, inv_n, n, mean,
                                                       m2);
    if (threadIdx.x == 0) {
      pr[2 * blockIdx.x] = mean;
      pr[2 * blockIdx.x + 1] = m2;
    }
  } else {
    auto count = [&](int i) {  // elements of part i
      const cl_i64 left = N - i * chunk;
      return (C)(left < chunk ? left : chunk);
    };
    C mu, rstd;
    merge_parts<WARP>(pr, G, count, inv_n, eps, row, mean_out, rstd_out, mu, rstd);
    typename Held<W, VEC>::type hg[NPT], hb[NPT];
    write_chunk<false, VEC, NPT, false>(p, (int)t0, (int)N, mu, rstd, gamma, beta, y + row * N,
                                        hg, hb);
  }
}

template <typename T, typename W, int VEC, int WARP, bool APPLY, bool PEEL = false>
__global__ void __launch_bounds__(1024)
norm_fwd_parts(CLN_FWD_PARAMS, typename Acc<T>::type* __restrict__ part) {
  fwd_parts<APPLY, T, W, VEC, WARP, T, false, PEEL>(CLN_FWD_ARGS, part);
}

template <typename T, typename W, typename H, int VEC, int WARP, bool APPLY,
          bool PEEL = false>
__global__ void __launch_bounds__(1024)
norm_fwd_add_parts(CLN_FWD_ADD_PARAMS, typename Acc<T>::type* __restrict__ part) {
  fwd_parts<APPLY, T, W, VEC, WARP, H, true, PEEL>(CLN_FWD_ARGS, part, res, ldr, hout);
}

// Rows of one chunk in 16-byte vectors, NPT per thread (the planner's choice: one vector for
// small M in at most fwd.row_warps whole warps; fwd.npt vectors for rows of 2 to
// fwd.row_npt_warps whole warps, whatever M; one row per block; rows of at most a warp, stacked
// blockDim.y a block, run too, but the planner no longer takes them): the row's threads fixed at
// compile time, no row loop, and the loads of gamma, beta and x issued first, together. The
// trap's branch after them ends the block of code they are in: without it ptxas scheduled
// gamma's and beta's loads after the row's first reduction, next to their use, so their memory
// trip followed x's instead of overlapping it (SASS, nvcc 13.0 sm_90). The launch must be TPR x
// blockDim.y threads (one row per block where TPR is more than a warp) in a grid of exactly
// ceil(M / blockDim.y) blocks. y's offsets are 32-bit: the planner takes this kernel only where
// M * N < 2^31.
template <typename T, typename W, int VEC, int WARP, int TPR, int NPT = 1>
__global__ void __launch_bounds__(TPR > WARP ? TPR : 1024) norm_fwd_row(CLN_FWD_PARAMS) {
  typedef typename Acc<T>::type C;
  const bool ln = is_ln<cln::either_norm>(mean_out);
  constexpr bool MANY = TPR <= WARP;  // rows stacked in blockDim.y, the last block partly past M
  const unsigned int row = MANY ? blockIdx.x * blockDim.y + threadIdx.y : blockIdx.x;
  const bool valid = !MANY || row < M;
  typename Held<W, VEC>::type hg[NPT], hb[NPT];
  Pack<T, VEC> raw[NPT];
  load_packs<VEC, NPT>(gamma, 0, N, gamma != nullptr, hg);
  load_packs<VEC, NPT>(beta, 0, N, beta != nullptr, hb);
  load_packs<VEC, NPT>(x + (cl_i64)(valid ? row : 0) * ldx, 0, N, valid, raw);
  const cl_i64 rows = blockDim.y;
  const bool grid_ok = MANY ? gridDim.x * rows >= M && (gridDim.x - 1) * rows < M
                            : blockDim.y == 1 && (cl_i64)gridDim.x == M;
  if ((int)blockDim.x != TPR || !grid_ok) cl_trap();
  typename RowVec<T, VEC>::type p[NPT];
#pragma unroll
  for (int k = 0; k < NPT; ++k) to_row(raw[k], p[k]);
  const C inv_n = cl_inv_count(C(0), N);
  C n = C(0), mean = C(0), m2 = C(0);
  chunk_stats<false, WARP, VEC, NPT, false, TPR, 1>(ln, p, 0, 0, N, (cl_i64)TPR * NPT * VEC, 0,
                                                    inv_n, n, mean, m2);
  const C mu = ln ? mean : C(0);
  const C rstd = cl_rsqrt(m2 * inv_n + eps);
  if (!valid) return;  // after the row's reductions, which take every thread of the block
  if (threadIdx.x == 0) {
    if (ln) mean_out[row] = (float)mu;
    rstd_out[row] = (float)rstd;
  }
  // one code path for the output: faster than the four cases
  write_chunk<true, VEC, NPT, false, true>(p, 0, (int)N, mu, rstd, gamma, beta,
                                           y + row * (int)N, hg, hb);
}
