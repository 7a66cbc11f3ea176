// cupyln common device code: storage types and conversions, vector I/O, reductions.
// Compiles with NVRTC (CUDA) and hipcc/hiprtc (HIP) alike: no headers, no hard-coded warp size
// (every reduction takes WARP, 32 or 64, as a template argument), maskless shuffles on HIP.

#if defined(__HIPCC__) || defined(__HIP__) || defined(__HIPCC_RTC__)
#define CLN_HIP 1
#endif

typedef long long cl_i64;

// Named template arguments: the host's name expressions (cupyln/_compile.py, Spec.names) spell
// a kernel's variant with these, so that a name says what the kernel is.
namespace cln {
constexpr bool layernorm = true, rmsnorm = false;
constexpr bool staged = true, direct = false;           // rows copied ahead into shared memory
constexpr bool params_early = true, params_late = false;  // gamma/beta loaded with the row
constexpr bool cols_full = true, cols_tested = false;   // every vector lies in the row
constexpr bool last_block_sums = true, partials = false;  // who sums dgamma/dbeta partials
constexpr bool tickets = true;                           // rows handed out by a counter
constexpr bool chunks = true, one_chunk = false;        // a row read in chunks (twice)
}  // namespace cln

// Stops the kernel with an error: for host/kernel mismatches that would give wrong results.
__device__ __forceinline__ void cl_trap() {
#ifdef CLN_HIP
  __builtin_trap();
#else
  __trap();
#endif
}

// 16-bit storage types: plain bits, converted explicitly so that the same source needs neither
// cuda_fp16.h nor hip_fp16.h (their availability differs between NVRTC and hiprtc versions).
struct cl_half { unsigned short bits; };
struct cl_bf16 { unsigned short bits; };

// Accumulation type: float32, except float64 for float64 data.
template <typename T> struct Acc { typedef float type; };
template <> struct Acc<double> { typedef double type; };

__device__ __forceinline__ float to_acc(float v) { return v; }
__device__ __forceinline__ double to_acc(double v) { return v; }
__device__ __forceinline__ float to_acc(cl_bf16 v) {
  return __uint_as_float(((unsigned int)v.bits) << 16);
}
__device__ __forceinline__ float to_acc(cl_half v) {
#ifdef CLN_HIP
  union { unsigned short u; _Float16 f; } c;
  c.u = v.bits;
  return (float)c.f;
#else
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v.bits));
  return f;
#endif
}

template <typename T> struct Store;
template <> struct Store<float> {
  static const bool is_bf16 = false;
  template <typename C> __device__ __forceinline__ static float cvt(C v) { return (float)v; }
};
template <> struct Store<double> {
  static const bool is_bf16 = false;
  template <typename C> __device__ __forceinline__ static double cvt(C v) { return (double)v; }
};
template <> struct Store<cl_half> {
  static const bool is_bf16 = false;
  __device__ __forceinline__ static cl_half cvt(float v) {
    cl_half h;
#ifdef CLN_HIP
    union { unsigned short u; _Float16 f; } c;
    c.f = (_Float16)v;
    h.bits = c.u;
#else
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.bits) : "f"(v));
#endif
    return h;
  }
};
template <> struct Store<cl_bf16> {
  static const bool is_bf16 = true;
  // Round to nearest even; NaN stays a (quiet) NaN of the same sign.
  __device__ __forceinline__ static cl_bf16 cvt(float v) {
    cl_bf16 b;
#if !defined(CLN_HIP) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(b.bits) : "f"(v));  // one instruction from sm_80 on
#else
    unsigned int u = __float_as_uint(v);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
      b.bits = (unsigned short)((u >> 16) | 0x0040u);
    } else {
      u += 0x7fffu + ((u >> 16) & 1u);
      b.bits = (unsigned short)(u >> 16);
    }
#endif
    return b;
  }
};

// 1 / n for a row length n >= 1. In float, IEEE division's fast path alone (a reciprocal and one
// Newton step, as nvcc emits it): for such n the result is a normal float, where that path is
// the correctly rounded quotient, so these are the bits of 1.0f / n. nvcc's range test and its
// slow-path call came first in every kernel and held back the row's first load (SASS).
__device__ __forceinline__ float cl_inv_count(float, cl_i64 n) {
  const float d = (float)n;
#if !defined(CLN_HIP) && defined(__CUDA_ARCH__)
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(d));
  return fmaf(r, fmaf(-d, r, 1.0f), r);
#else
  return 1.0f / d;
#endif
}
__device__ __forceinline__ double cl_inv_count(double, cl_i64 n) { return 1.0 / (double)n; }
__device__ __forceinline__ float cl_rsqrt(float v) { return rsqrtf(v); }
__device__ __forceinline__ double cl_rsqrt(double v) { return 1.0 / sqrt(v); }
// a * b + c in one rounding. Written out where the compiler would otherwise multiply once and
// add the product to two sums (the backward's dy * xhat): one FMUL + two FADD become two FMA.
__device__ __forceinline__ float cl_fma(float a, float b, float c) { return fmaf(a, b, c); }
__device__ __forceinline__ double cl_fma(double a, double b, double c) { return fma(a, b, c); }
// a * b rounded by itself: never contracted into a later addition. For a product both kept
// and subtracted (the forward's mean), where nvcc fused it into the subtraction in one kernel
// and not in another, so that their outputs differed in the last bit.
__device__ __forceinline__ float cl_mul(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double cl_mul(double a, double b) { return __dmul_rn(a, b); }

// ---------------------------------------------------------------------------------------------
// Vector I/O: V consecutive elements in one access (16 bytes when V * sizeof(T) == 16). The
// planner picks V so that every pointer and row stride it is used with is aligned to it.
template <typename T, int V> struct alignas(sizeof(T) * V) Pack { T v[V]; };

// The float16 in half `hi` of a word (one conversion instruction on CUDA).
__device__ __forceinline__ float half_of(unsigned int w, bool hi) {
#ifdef CLN_HIP
  cl_half h;
  h.bits = (unsigned short)(hi ? w >> 16 : w & 0xffffu);
  return to_acc(h);
#else
  float f;
  if (hi)
    asm("{.reg .b16 l, h;\n mov.b32 {l, h}, %1;\n cvt.f32.f16 %0, h;}" : "=f"(f) : "r"(w));
  else
    asm("{.reg .b16 l, h;\n mov.b32 {l, h}, %1;\n cvt.f32.f16 %0, l;}" : "=f"(f) : "r"(w));
  return f;
#endif
}

// The 16-bit value of type T in half `hi` of a word, converted (bfloat16: a shift or a mask;
// float16: one conversion).
template <typename T>
__device__ __forceinline__ float half_value(unsigned int w, bool hi) {
  if constexpr (Store<T>::is_bf16)
    return __uint_as_float(hi ? (w & 0xffff0000u) : (w << 16));
  else
    return half_of(w, hi);
}

// Element j of a pack, converted to the accumulation type. 16-bit pairs are read as the 32-bit
// word holding them, never as 16-bit halves: those cost a byte-permute instruction each (seen in
// the backward's SASS).
template <typename T, int V>
__device__ __forceinline__ typename Acc<T>::type elem(const Pack<T, V>& p, int j) {
  if constexpr (sizeof(T) == 2 && V % 2 == 0)
    return half_value<T>(reinterpret_cast<const unsigned int*>(p.v)[j >> 1], j & 1);
  else
    return (typename Acc<T>::type)to_acc(p.v[j]);
}

// A pack of 16-bit values stored as the 32-bit words that hold them: for packs kept in registers
// across a loop (gamma, beta). A Pack held there is kept one 16-bit member per register, each
// zero-filled and extracted by a byte-permute that waits for the load; in the small-M forward's
// SASS those permutes stood between gamma's, beta's and the row's loads, so the three memory
// trips ran one after another.
template <typename T, int V> struct alignas(sizeof(T) * V) PackW {
  unsigned int w[sizeof(T) * V / 4];
};
template <typename T, int V>
__device__ __forceinline__ float elem(const PackW<T, V>& p, int j) {
  return half_value<T>(p.w[j >> 1], j & 1);
}
// The type of a pack held across a loop: words where the pack is 16-bit pairs.
template <typename T, int V, bool WORDS = sizeof(T) == 2 && V % 2 == 0> struct Held {
  typedef Pack<T, V> type;
};
template <typename T, int V> struct Held<T, V, true> { typedef PackW<T, V> type; };

// V values converted to the accumulation type (a row kept unpacked in registers).
template <typename C, int V> struct Vals { C v[V]; };
template <typename C, int V>
__device__ __forceinline__ C elem(const Vals<C, V>& p, int j) { return p.v[j]; }

template <typename T, int V>
__device__ __forceinline__ void to_row(const Pack<T, V>& raw, Pack<T, V>& r) { r = raw; }
template <typename T, int V, typename C>
__device__ __forceinline__ void to_row(const Pack<T, V>& raw, Vals<C, V>& r) {
#pragma unroll
  for (int j = 0; j < V; ++j) r.v[j] = (C)elem(raw, j);
}

template <int V, typename T, typename C>
__device__ __forceinline__ void load_vec(const T* __restrict__ p, C (&out)[V]) {
  const Pack<T, V> pk = *reinterpret_cast<const Pack<T, V>*>(p);
#pragma unroll
  for (int j = 0; j < V; ++j) out[j] = (C)elem(pk, j);
}

// Raw loads of NPT vectors of a row (zero outside [0, N) and for invalid rows): kept as packed
// storage while the loads are in flight. FULL: the caller knows every vector lies below N (no
// test per vector).
template <int VEC, int NPT, bool FULL = false, typename T, typename P>
__device__ __forceinline__ void load_packs(const T* __restrict__ row, cl_i64 c0, cl_i64 N,
                                           bool valid, P (&p)[NPT]) {
  static_assert(sizeof(P) == sizeof(T) * VEC, "a pack is VEC elements of T");
#pragma unroll
  for (int k = 0; k < NPT; ++k) {
    const cl_i64 col = c0 + ((cl_i64)k * blockDim.x + threadIdx.x) * VEC;
    p[k] = P{};
    if (valid && (FULL || col < N)) p[k] = *reinterpret_cast<const P*>(row + col);
  }
}

// A row's vectors as kept in registers: bfloat16 stays packed (each use converts with a shift or
// a mask), other types are converted once (float16 conversions are not free: measured slower
// packed, 4096x8192 f16 51.1 vs 42.7 us).
template <typename T, int VEC> struct RowVec { typedef Vals<typename Acc<T>::type, VEC> type; };
template <int VEC> struct RowVec<cl_bf16, VEC> { typedef Pack<cl_bf16, VEC> type; };

template <int VEC, int NPT, bool FULL = false, typename T, typename R>
__device__ __forceinline__ void load_row(const T* __restrict__ row, cl_i64 c0, cl_i64 N,
                                         bool valid, R (&p)[NPT]) {
  Pack<T, VEC> raw[NPT];
  load_packs<VEC, NPT, FULL>(row, c0, N, valid, raw);
#pragma unroll
  for (int k = 0; k < NPT; ++k) to_row(raw[k], p[k]);
}

// Asynchronous copies into shared memory (cp.async, CUDA sm_80 on). The backward stages the
// next row's vectors while it reduces and writes this one, so loads stay in flight through the
// row's reductions without registers to hold them (a register prefetch had cost more
// instructions than it saved). Each thread reads back only the slots it wrote itself: the
// copies need the thread's own wait, no barrier.
#if !defined(CLN_HIP) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define CLN_ASYNC_COPY 1
#else
#define CLN_ASYNC_COPY 0
#endif

// Copy NPT vectors of a row into shared memory (zero-filled outside [0, N) and for invalid rows:
// nothing is read there). Packs of 4, 8 or 16 bytes, or several 16-byte pieces. Per thread
// (PER_BLOCK false): into dst[k * blockDim.x * blockDim.y + tid], skipping L1 where it can. Per
// block (gamma, the same columns for every row of a block): the threads of row 0 copy into
// dst[k * blockDim.x + threadIdx.x] through L1; the other rows read those slots after a barrier.
// (Every thread copying gamma itself sent every block's copies of the same few lines to L2 at
// once: 131072x64 RMSNorm 40.9 us against 25.9 with gamma read from global memory.)
template <int VEC, int NPT, bool PER_BLOCK = false, typename T, typename P>
__device__ __forceinline__ void stage_packs(P* dst, const T* __restrict__ row, cl_i64 c0,
                                            cl_i64 N, bool valid) {
  constexpr int B = (int)sizeof(P);
  static_assert(B == sizeof(T) * VEC, "a pack is VEC elements of T");
  // cp.async copies 4, 8 or 16 bytes: smaller packs are never staged (the caller's rule)
  constexpr bool COPIES = CLN_ASYNC_COPY && (B == 4 || B == 8 || B % 16 == 0);
  if (!COPIES || (PER_BLOCK && threadIdx.y != 0)) return;
#if CLN_ASYNC_COPY
  const int threads = PER_BLOCK ? blockDim.x : blockDim.x * blockDim.y;
  const int tid = PER_BLOCK ? threadIdx.x : threadIdx.y * blockDim.x + threadIdx.x;
  constexpr int S = B < 16 ? B : 16;  // bytes per copy
#pragma unroll
  for (int k = 0; k < NPT; ++k) {
    const cl_i64 col = c0 + ((cl_i64)k * blockDim.x + threadIdx.x) * VEC;
    const bool ok = valid && col < N;
    const char* src = reinterpret_cast<const char*>(ok ? row + col : row);  // unread unless ok
    const unsigned int s = (unsigned int)__cvta_generic_to_shared(dst + k * threads + tid);
#pragma unroll
    for (int i = 0; i < B; i += S) {
      if constexpr (S == 16 && !PER_BLOCK)  // .cg: a row is read once, L1 can be skipped
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(s + i),
                     "l"(src + (ok ? i : 0)), "r"(ok ? 16 : 0) : "memory");
      else
        asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;" ::"r"(s + i),
                     "l"(src + (ok ? i : 0)), "n"(S), "r"(ok ? S : 0) : "memory");
    }
  }
#endif
}

__device__ __forceinline__ void async_commit() {
#if CLN_ASYNC_COPY
  asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}

// Traps when the launch gave less dynamic shared memory than `bytes` (a host/kernel mismatch
// would otherwise overrun it silently).
__device__ __forceinline__ void require_dynamic_smem(unsigned int bytes) {
#if CLN_ASYNC_COPY
  unsigned int have;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(have));
  if (have < bytes) cl_trap();
#endif
}

// Wait until at most PENDING of this thread's committed copy groups are still in flight.
template <int PENDING> __device__ __forceinline__ void async_wait() {
#if CLN_ASYNC_COPY
  asm volatile("cp.async.wait_group %0;" ::"n"(PENDING) : "memory");
#endif
}

// Two floats as one 32-bit word of two 16-bit values (lo first in memory); one instruction.
template <typename T>
__device__ __forceinline__ unsigned int pack2(float lo, float hi) {
  unsigned int w;
#if !defined(CLN_HIP) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (Store<T>::is_bf16)
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(w) : "f"(hi), "f"(lo));
  else
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(w) : "f"(hi), "f"(lo));
#else
  w = (unsigned int)Store<T>::cvt(lo).bits | ((unsigned int)Store<T>::cvt(hi).bits << 16);
#endif
  return w;
}

// V values rounded to T, as one pack.
template <typename T, int V, typename C>
__device__ __forceinline__ Pack<T, V> pack_vec(const C (&in)[V]) {
  Pack<T, V> pk;
  if constexpr (sizeof(T) == 2 && V % 2 == 0) {  // 16-bit pairs: half the conversions
    unsigned int* w = reinterpret_cast<unsigned int*>(pk.v);
#pragma unroll
    for (int j = 0; j < V; j += 2) w[j / 2] = pack2<T>((float)in[j], (float)in[j + 1]);
  } else {
#pragma unroll
    for (int j = 0; j < V; ++j) pk.v[j] = Store<T>::cvt(in[j]);
  }
  return pk;
}

template <typename T, int V>
__device__ __forceinline__ void store_pack(T* __restrict__ p, const Pack<T, V>& pk) {
#ifndef CLN_HIP
  if constexpr (sizeof(pk) == 16) {  // one 16-byte store: NVVM split the backward's in four
    const unsigned int* w = reinterpret_cast<const unsigned int*>(&pk);
    asm volatile(
        "{.reg .u64 g;\n cvta.to.global.u64 g, %0;\n st.global.v4.b32 [g], {%1, %2, %3, %4};}"
        ::"l"(p), "r"(w[0]), "r"(w[1]), "r"(w[2]), "r"(w[3]));
    return;
  }
#endif
  *reinterpret_cast<Pack<T, V>*>(p) = pk;
}

template <int V, typename T, typename C>
__device__ __forceinline__ void store_vec(T* __restrict__ p, const C (&in)[V]) {
  store_pack(p, pack_vec<T>(in));
}

// The fused residual add: NPT vectors of h = x + residual (in H, the residual stream's type)
// stored to `h` (valid rows, columns below N) and kept in registers as the row, exactly as
// stored, so the statistics are those of the h that the backward will read.
template <int VEC, int NPT, typename T, typename H, typename R>
__device__ __forceinline__ void load_row_add(const T* __restrict__ x, const H* __restrict__ res,
                                             H* __restrict__ h, cl_i64 c0, cl_i64 N,
                                             bool valid, R (&p)[NPT]) {
  typedef typename Acc<H>::type C;
  Pack<T, VEC> px[NPT];
  Pack<H, VEC> pr[NPT];
  load_packs<VEC, NPT>(x, c0, N, valid, px);
  load_packs<VEC, NPT>(res, c0, N, valid, pr);
#pragma unroll
  for (int k = 0; k < NPT; ++k) {
    C s[VEC];
#pragma unroll
    for (int j = 0; j < VEC; ++j) s[j] = (C)elem(px[k], j) + (C)elem(pr[k], j);
    const Pack<H, VEC> hk = pack_vec<H>(s);
    const cl_i64 col = c0 + ((cl_i64)k * blockDim.x + threadIdx.x) * VEC;
    if (valid && col < N) store_pack(h + col, hk);
    to_row(hk, p[k]);
  }
}

// ---------------------------------------------------------------------------------------------
// Reductions. A row belongs to `tpr` consecutive threads of a block (blockDim.x == tpr): a power
// of two up to WARP, or a multiple of WARP (then blockDim.y rows share the block's warps in
// whole warps). Every thread of the row gets the same, bitwise identical totals: xor butterflies
// add the same pairs on every lane, and the cross-warp step sums warps in a fixed order.
template <typename C> __device__ __forceinline__ C shfl_xor(C v, int lane_mask) {
#ifdef CLN_HIP
  return __shfl_xor(v, lane_mask);
#else
  return __shfl_xor_sync(0xffffffffu, v, lane_mask);
#endif
}

// The threads of a row: TPR where the kernel fixes it at compile time (its caller has checked
// the launch), else blockDim.x.
template <int TPR> __device__ __forceinline__ int row_threads() {
  return TPR ? TPR : (int)blockDim.x;
}

// Shuffle-only part: sum over the row's threads within one warp (all of the row when tpr <= WARP).
// Rows of whole warps take the unrolled butterfly (a loop on blockDim.x cost a compare and a
// branch per step on the row's critical path).
template <int WARP, int TPR = 0, int K, typename C>
__device__ __forceinline__ void warp_allreduce(C (&v)[K]) {
  if (row_threads<TPR>() >= WARP) {
#pragma unroll
    for (int o = WARP >> 1; o > 0; o >>= 1) {
#pragma unroll
      for (int k = 0; k < K; ++k) v[k] += shfl_xor(v[k], o);
    }
    return;
  }
  for (int o = row_threads<TPR>() >> 1; o > 0; o >>= 1) {
#pragma unroll
    for (int k = 0; k < K; ++k) v[k] += shfl_xor(v[k], o);
  }
}

// Sum over the row's threads. Rows of several warps exchange warp sums through shared memory
// with one barrier: `phase` alternates between consecutive calls (the caller's row counter), so
// a fast warp's next write goes to the other buffer while slow warps still read this one.
// TPR (> 0): the row's threads fixed at compile time (the row kernel), so the branches and the
// butterfly's trip count below are constants.
template <int WARP, int TPR = 0, int K, typename C>
__device__ __forceinline__ void row_allreduce(C (&v)[K], int phase) {
  __shared__ C red[2][K][1024 / WARP];
  warp_allreduce<WARP, TPR>(v);
  const int tpr = row_threads<TPR>();
  if (tpr > WARP) {  // uniform over the block
    const int tid = threadIdx.y * tpr + threadIdx.x;
    const int warp = tid / WARP, lane = tid % WARP;
    const int nw = tpr / WARP;
    if (lane == 0) {
#pragma unroll
      for (int k = 0; k < K; ++k) red[phase & 1][k][warp] = v[k];
    }
    __syncthreads();
    // The butterfly spans only the power of two of lanes that covers the nw warp sums (one step
    // for a row of two warps, not WARP's five); each such group of lanes reads its own copy of
    // the sums, so every lane gets the total. The steps left out added zeros: the same bits.
    const int top = 1 << (31 - __clz(nw - 1));  // half that power of two
    const int src = lane & (2 * top - 1);
#pragma unroll
    for (int k = 0; k < K; ++k)
      v[k] = src < nw ? red[phase & 1][k][threadIdx.y * nw + src] : C(0);
    for (int o = top; o > 0; o >>= 1) {
#pragma unroll
      for (int k = 0; k < K; ++k) v[k] += shfl_xor(v[k], o);
    }
  }
}

// (count, mean, M2) statistics merged with Chan et al.'s pairwise formula: numerically stable,
// never E[x^2] - E[x]^2. (n, mean, m2) takes (nb, mb, m2b) in.
template <typename C>
__device__ __forceinline__ void chan_merge(C& n, C& mean, C& m2, C nb, C mb, C m2b) {
  const C tot = n + nb;
  const C delta = mb - mean;
  const C f = tot > C(0) ? nb / tot : C(0);
  mean += delta * f;
  m2 += m2b + delta * delta * n * f;
  n = tot;
}


// Thread-block clusters (CUDA sm_90 on): rows longer than one block holds are split into CL
// column tiles, one per block of a cluster, and the blocks exchange their tiles' sums through
// distributed shared memory instead of a second pass reading the rows again. The forward and
// the backward's long rows use cluster_allreduce; the backward's column sums, bwd_common.cuh.


#if !defined(CLN_HIP) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define CLN_CLUSTERS 1
#define CLN_CLUSTER_DIMS(x, y, z) __cluster_dims__(x, y, z)
#else
#define CLN_CLUSTERS 0
#define CLN_CLUSTER_DIMS(x, y, z)
#endif

// Barrier of every thread of every block of the cluster (release, then acquire).
__device__ __forceinline__ void cluster_sync() {
#if CLN_CLUSTERS
  asm volatile("barrier.cluster.arrive.release;\n barrier.cluster.wait.acquire;" ::: "memory");
#endif
}

#if CLN_CLUSTERS
// The row sums of the blocks of a cluster, exchanged without a cluster barrier per row, and
// without a block barrier: every warp stores its K warp sums into its slot of every block's
// `recv` with st.async (lane r to rank r), whose bytes complete a transaction on the receiving
// block's mbarrier; a block waits on its own mbarrier, then each lane adds its slots and the
// warp's butterfly adds the lanes' (the same order in every block: bitwise the same totals). A
// cluster barrier per row (barrier.cluster.arrive.release) compiled to MEMBAR.ALL.GPU, which
// waits for the thread's outstanding memory operations, the next row's copies included:
// 4096x16384 f16 took 16% longer with it than with the barrier relaxed (which orders
// nothing, so it is not an option). Two buffers alternate by row. A warp writes a block's buffer
// again (two rows later) only after its own wait of the row in between, which completes only
// once every warp of every block sent that row's sums; each warp sends them after the butterfly
// that added the values it read from that buffer (it waits for the reads), so after it read them.
template <int S, int K, typename C> struct __align__(16) ClusterExchange {
  C recv[2][S][K];            // [buffer][rank * warps + warp][k]; st.async of two doubles: 16 B
  unsigned long long bar[2];  // mbarrier per buffer: one arrival and the slots' bytes to complete
};
template <int S, int K, typename C>
__device__ __forceinline__ ClusterExchange<S, K, C>& cluster_exchange() {
  __shared__ ClusterExchange<S, K, C> x;
  return x;
}
__device__ __forceinline__ unsigned int smem_addr(const void* p) {
  return (unsigned int)__cvta_generic_to_shared(p);
}
__device__ __forceinline__ unsigned int cluster_addr(unsigned int a, unsigned int rank) {
  unsigned int r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(rank));
  return r;
}
__device__ __forceinline__ unsigned int cluster_rank() {
  unsigned int r;
  asm("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
// The mbarriers at shared addresses `bar`: made ready for one arrival per phase; that arrival,
// announcing `bytes` of st.async stores to come; and the wait for the phase of `parity` to
// complete (acquire at cluster scope: the stored values are visible after it).
__device__ __forceinline__ void mbarrier_init(unsigned int bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbarrier_expect(unsigned int bar, unsigned int bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbarrier_wait(unsigned int bar, unsigned int parity) {
  unsigned int done = 0;
  do {
    asm volatile(
        "{.reg .pred p;\n mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n"
        " selp.u32 %0, 1, 0, p;}" : "=r"(done) : "r"(bar), "r"(parity) : "memory");
  } while (!done);
}
__device__ __forceinline__ void st_async2(unsigned int a, float v0, float v1, unsigned int bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.f32 [%0], {%1, %2}, [%3];"
               ::"r"(a), "f"(v0), "f"(v1), "r"(bar) : "memory");
}
__device__ __forceinline__ void st_async2(unsigned int a, double v0, double v1, unsigned int bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.f64 [%0], {%1, %2}, [%3];"
               ::"r"(a), "d"(v0), "d"(v1), "r"(bar) : "memory");
}
__device__ __forceinline__ void st_async1(unsigned int a, float v, unsigned int bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.f32 [%0], %1, [%2];"
               ::"r"(a), "f"(v), "r"(bar) : "memory");
}
__device__ __forceinline__ void st_async1(unsigned int a, double v, unsigned int bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.f64 [%0], %1, [%2];"
               ::"r"(a), "d"(v), "r"(bar) : "memory");
}
#endif

// The exchange's slots of a cluster of CL blocks of at most THREADS threads (its launch bound).
template <int CL, int WARP, int THREADS> __host__ __device__ constexpr int cluster_slots() {
  return CL * (THREADS / WARP);
}

// Before the first cluster_allreduce: the mbarriers initialized, and visible to the cluster
// before any block stores into another. S: the exchange's slots (CL times the most warps).
template <int S, int K, typename C> __device__ __forceinline__ void cluster_allreduce_init() {
#if CLN_CLUSTERS
  auto& x = cluster_exchange<S, K, C>();
  if (threadIdx.x == 0 && threadIdx.y == 0) {
#pragma unroll
    for (int b = 0; b < 2; ++b) mbarrier_init(smem_addr(&x.bar[b]));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  asm volatile("barrier.cluster.arrive.relaxed;\n barrier.cluster.wait;" ::: "memory");
#endif
}

// Before a kernel's first exchange: its launch must be rows split over CL blocks along y, one
// row per block in whole warps (a mismatch traps), and the exchange's mbarriers are made ready.
template <int CL, int WARP, int S, int K, typename C>
__device__ __forceinline__ void cluster_rows_init() {
  if (gridDim.y != CL || blockDim.y != 1 || blockDim.x % WARP != 0) cl_trap();
  cluster_allreduce_init<S, K, C>();
}

// Sums over the row's threads in the CL blocks of a cluster (blockDim = (whole warps, 1), at
// most S / CL warps) of this row's K values (one or two); `phase` counts the calls.
template <int CL, int S, int WARP, int K, typename C>
__device__ __forceinline__ void cluster_allreduce(C (&v)[K], int phase) {
  static_assert(K == 1 || K == 2, "one or two row sums");
#if CLN_CLUSTERS
  warp_allreduce<WARP>(v);
  auto& x = cluster_exchange<S, K, C>();
  const int b = phase & 1;
  const int lane = threadIdx.x % WARP, nw = blockDim.x / WARP, slots = CL * nw;
  const unsigned int bar = smem_addr(&x.bar[b]);
  if (threadIdx.x == 0) mbarrier_expect(bar, (unsigned int)(slots * K * sizeof(C)));
  if (lane < CL) {
    const unsigned int slot = smem_addr(&x.recv[b][cluster_rank() * nw + threadIdx.x / WARP][0]);
    if constexpr (K == 2) st_async2(cluster_addr(slot, lane), v[0], v[1], cluster_addr(bar, lane));
    else st_async1(cluster_addr(slot, lane), v[0], cluster_addr(bar, lane));
  }
  mbarrier_wait(bar, (unsigned int)(phase >> 1) & 1u);  // this buffer's (phase / 2)-th completion
#pragma unroll
  for (int k = 0; k < K; ++k) v[k] = C(0);
  for (int i = lane; i < slots; i += WARP)
#pragma unroll
    for (int k = 0; k < K; ++k) v[k] += x.recv[b][i][k];
  warp_allreduce<WARP>(v);
#else
  cl_trap();  // the planner launches cluster kernels only where clusters exist
#endif
}

// Backward-only device code: the row ticket counter, the column sums of one cluster, the column
// sums over a block's rows and the fixed-order sums of dgamma/dbeta partials.


// Rows of a grid of resident blocks taken dynamically (the staged backward where it need not be
// deterministic): block b of nb takes groups (of rows; `groups` in all, < 2^31) b, b + nb,
// b + 2nb and b + 3nb in its iterations 0-3, then group 4nb + t for each ticket t that its
// thread 0 takes from `tickets` (zeroed). A fast block takes more groups than a slow one; a
// static assignment cannot follow SMs of different speeds (resident forward grids ran 5-12%
// slower than one-row blocks with static rows, 1-2% with tickets). In each iteration thread 0
// takes (take) the group of the iteration after the next two, from the ticket it took an
// iteration earlier, so the ticket's round trip never holds up a row (taken in the same
// iteration, a backward ran 13% slower than static rows); the kernel hands it on to its
// threads through shared memory before the row's reduction barrier, and every thread moves on
// (advance) after that barrier. The next two groups stay in registers: kept in shared memory
// instead (a ring of 4 slots), the backward ran 18-32% slower. Thread 0 stops after its
// first ticket past the last group, so a launch takes exactly groups - 3nb tickets, and
// atomicInc's wrap leaves the counter at 0 for the next launch.
struct RowTickets {
  unsigned int* tickets;
  unsigned int groups;
  unsigned int nxt, nxt2;  // the groups of the next two iterations
  unsigned int pending, raw;  // thread 0: the group after those, the last ticket (~0u: none)
  __device__ __forceinline__ RowTickets(unsigned int* t, unsigned int g)
      : tickets(t), groups(g), nxt(blockIdx.x + gridDim.x), nxt2(blockIdx.x + 2 * gridDim.x),
        pending(blockIdx.x + 3 * gridDim.x), raw(~0u) {}
  // thread 0, each iteration: the group of the iteration after the next two; takes the ticket
  // of the one after that
  __device__ __forceinline__ unsigned int take() {
    const unsigned int nb = gridDim.x;
    if (raw != ~0u) pending = 4 * nb + raw;  // taken an iteration ago: it has arrived
    raw = pending < groups ? atomicInc(tickets, groups - 3 * nb - 1) : ~0u;
    return pending;
  }
  // every thread, after the row's barrier: the group of the next iteration; `later` (the one
  // handed on this iteration) after the two it holds
  __device__ __forceinline__ unsigned int advance(unsigned int later) {
    const unsigned int g = nxt;
    nxt = nxt2;
    nxt2 = later;
    return g;
  }
};

// Column sums over the XC blocks of a cluster (CUDA sm_90 on), in rank order: column c of
// [0, ncols) is summed by block c % XC, which receives every block's value of it in `recv`
// ([XC][per] values, per = ceil(ncols / XC)) by st.async, counted on its mbarrier. No global
// memory, fence or ticket counter, unlike the last-block sums; every block sends its values
// (zeros where it had no rows), so the sums do not depend on timing.
template <int XC, typename C> struct ClusterSums {
  C* recv;
  cl_i64 per;
  unsigned int rank, bar;

  // Columns c in [lo, hi) that this block sums (c % XC == rank).
  __device__ __forceinline__ cl_i64 owned(cl_i64 lo, cl_i64 hi) const {
    auto below = [&](cl_i64 n) { return n > rank ? (n - rank + XC - 1) / XC : cl_i64(0); };
    return below(hi) - below(lo);
  }
  // Every thread, before any other call: the mbarrier made ready for the values this block will
  // receive (XC per column that count(*this) says it sums), and the cluster barrier's arrival
  // (its wait is in ready()).
  template <typename F>
  __device__ __forceinline__ void init(C* buf, cl_i64 ncols, unsigned long long* mbar, F count) {
#if CLN_CLUSTERS
    recv = buf;
    per = (ncols + XC - 1) / XC;
    rank = cluster_rank();
    bar = smem_addr(mbar);
    if (threadIdx.x == 0 && threadIdx.y == 0) {
      mbarrier_init(bar);
      mbarrier_expect(bar, (unsigned int)(count(*this) * XC * sizeof(C)));
      asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    asm volatile("barrier.cluster.arrive.relaxed;" ::: "memory");
#else
    cl_trap();  // the planner launches cluster kernels only where clusters exist
#endif
  }
  // Every thread, before the first send: every block's mbarrier is initialized.
  __device__ __forceinline__ void ready() const {
#if CLN_CLUSTERS
    asm volatile("barrier.cluster.wait;" ::: "memory");
#endif
  }
  // This block's value of column c, to the block that sums it.
  __device__ __forceinline__ void send(cl_i64 c, C v) const {
#if CLN_CLUSTERS
    const unsigned int owner = (unsigned int)(c % XC);
    const unsigned int slot = smem_addr(recv + rank * per + c / XC);
    st_async1(cluster_addr(slot, owner), v, cluster_addr(bar, owner));
#endif
  }
  // Every thread: waits until every block's values of this block's columns have landed, calls
  // emit(c, sum) for each (sum over ranks 0, 1, ...), then waits at a cluster barrier, so no
  // block leaves while values may still be on their way to another.
  template <typename F> __device__ __forceinline__ void finish(cl_i64 ncols, F emit) const {
#if CLN_CLUSTERS
    mbarrier_wait(bar, 0);
    const int threads = blockDim.x * blockDim.y;
    for (cl_i64 j = threadIdx.y * blockDim.x + threadIdx.x; j < per; j += threads) {
      const cl_i64 c = j * XC + rank;
      if (c >= ncols) break;
      C s = C(0);
#pragma unroll
      for (int r = 0; r < XC; ++r) s += recv[r * per + j];
      emit(c, s);
    }
    // relaxed: the mbarrier waits already ordered the values; this only keeps blocks alive
    asm volatile("barrier.cluster.arrive.relaxed;\n barrier.cluster.wait;" ::: "memory");
#endif
  }
};


// Column sums over the blockDim.y (> 1) rows of a block, each in a fixed order (row 0, 1, ...):
// the threads put their V consecutive columns in `buf` (blockDim.x * blockDim.y * V values),
// then all threads of the block share the blockDim.x * V columns, so no thread sums alone.
// Calls emit(column, sum) once per column, from the thread that summed it (columns relative to
// the block's first). Every thread of the block must call it.
template <int V, typename C, typename F>
__device__ __forceinline__ void block_column_sums(const C (&v)[V], C* buf, F emit) {
  const int tpr = blockDim.x, rows = blockDim.y;
  const int cols = tpr * V;
  __syncthreads();  // buf may still be read by the previous call's threads
#pragma unroll
  for (int j = 0; j < V; ++j) buf[threadIdx.y * cols + threadIdx.x * V + j] = v[j];
  __syncthreads();
  for (int c = threadIdx.y * tpr + threadIdx.x; c < cols; c += tpr * rows) {
    C s = C(0);
#pragma unroll 4
    for (int r = 0; r < rows; ++r) s += buf[r * cols + c];
    emit(c, s);
  }
}

// A load that skips L1: data written by other blocks (of this launch or an earlier one).
template <typename C> __device__ __forceinline__ C load_l2(const C* p) {
#if CLN_HIP
  return *reinterpret_cast<const volatile C*>(p);
#else
  return __ldcg(p);
#endif
}

// The dgamma/dbeta partials of P blocks ([P, stride] rows), summed over P in one fixed order:
// eight interleaved groups (group r takes rows r, r + 8, r + 16, ...), each summed in row order,
// then the eight added in order. This computes groups r0 .. r0 + G - 1 of column `col`, their
// loads issued together. norm_bwd_reduce spreads the groups over threadIdx.y (G = 1); a backward
// of few blocks sums its own partials in its last block, all eight in one thread (G = 8): the
// same order, the same bits. L2: the partials were written by other blocks of this launch, so
// they are read past L1 (load_l2); a later launch reads them with plain loads, which the
// compiler may route through the read-only path (192x1024 bf16 backward 7% faster than with
// load_l2).
template <int G, bool L2, typename C>
__device__ __forceinline__ void partial_groups(const C* col, int r0, cl_i64 P,
                                               cl_i64 stride, C (&s)[G]) {
#pragma unroll
  for (int j = 0; j < G; ++j) s[j] = C(0);
  for (cl_i64 p = r0; p < P; p += 8) {
#pragma unroll
    for (int j = 0; j < G; ++j)
      if (p + j < P) s[j] += L2 ? load_l2(col + (p + j) * stride) : col[(p + j) * stride];
  }
}

// Forward pass of LayerNorm (LN = true) and RMSNorm (LN = false), one template for both.
//
// Geometry (decided by cupyln/_plan.py alone): blockDim = (tpr, rows per block). A row is held
// in registers as chunks of tpr * NPT * VEC elements; thread t owns vectors k * tpr + t of a
// chunk. When the row is one chunk (the common case) x is read from memory once; longer rows
// are read twice (statistics, then output), or on sm_90 split over the blocks of a cluster
// (CL > 1: blockDim = (tpr, 1), gridDim.y = CL). Where blocks loop over rows, the staged variant
// (STAGE, CUDA sm_80 on) copies each block's next rows into shared memory while it reduces and
// writes these, as the backward does. Statistics are exact per chunk (sum, then centered
// sum of squares) and merged across chunks with Chan's formula: never E[x^2] - E[x]^2.

// Sum over a row's threads: of one block, or (CL > 1) of the CL blocks of a cluster.
template <int CL, int WARP, int TPR, typename C>
__device__ __forceinline__ void tile_allreduce(C (&v)[1], int phase) {
  if constexpr (CL > 1) cluster_allreduce<CL, cluster_slots<CL, WARP, 1024>(), WARP>(v, phase);
  else row_allreduce<WARP, TPR>(v, phase);
}

// Statistics of one chunk held in p, merged into the row's (n, mean, m2), identical on every
// thread of the row: exact two-pass on the chunk (sum, then centered sum of squares), then
// Chan's formula across chunks. RMSNorm keeps only the sum of squares (in m2). Two reductions
// per chunk, one barrier each (phase 2c and 2c + 1 alternate the buffers). Measured on the H200
// (tune.py, one machine) against merging per-warp (count, mean, M2) after one barrier: 131072x4096
// bf16 559 vs 620 us, 16384x8192 bf16 159 vs 173 us.
// A row of one chunk (CHUNKED = false) takes the chunk's statistics as they are, with
// `inv_cnt` = 1 / N: no division and no merge on the row's critical path. FULL: every vector
// lies below N (see fwd_rows). CL > 1: the chunk spans the CL blocks of a cluster (from c0, this
// block's part from t0), whose sums cluster_allreduce adds.
template <bool CHUNKED, bool LN, int WARP, int VEC, int NPT, bool FULL, int TPR, int CL,
          typename R, typename C>
__device__ __forceinline__ void chunk_stats(const R (&p)[NPT], cl_i64 c0, cl_i64 t0, cl_i64 N,
                                            cl_i64 chunk, int phase, C inv_cnt, C& n, C& mean,
                                            C& m2) {
  C s[1] = {C(0)};
#pragma unroll
  for (int k = 0; k < NPT; ++k)
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const C v = (C)elem(p[k], j);
      s[0] += LN ? v : v * v;
    }
  // Consecutive calls alternate the reduction buffers: LayerNorm calls twice per chunk (2p and
  // 2p + 1), RMSNorm once (p). racecheck found RMSNorm at 2p (always the same buffer) racing.
  tile_allreduce<CL, WARP, TPR>(s, LN ? 2 * phase : phase);
  if (!LN) {
    m2 += s[0];
    return;
  }
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
template <bool HELD, int VEC, int NPT, bool FULL, bool ONE_PATH = false, typename T, typename W,
          typename C, typename R, typename H>
__device__ __forceinline__ void write_chunk(const R (&p)[NPT], int c0, int N, C mu,
                                            C rstd, const W* __restrict__ gamma,
                                            const W* __restrict__ beta, T* __restrict__ yr,
                                            const H (&hg)[NPT], const H (&hb)[NPT]) {
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
    store_vec<VEC>(yr + col, o);
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
template <bool CHUNKED, bool STAGE, bool EARLY_PARAMS, typename T, typename W, bool LN, int VEC,
          int NPT, int WARP, bool FULL = false, typename H = T, bool ADD = false, int CL = 1>
__device__ __forceinline__ void fwd_rows(const T* __restrict__ x, cl_i64 ldx,
                                         const W* __restrict__ gamma, const W* __restrict__ beta,
                                         T* __restrict__ y, float* __restrict__ mean_out,
                                         float* __restrict__ rstd_out, cl_i64 M, cl_i64 N,
                                         typename Acc<T>::type eps,
                                         const H* __restrict__ res = nullptr, cl_i64 ldr = 0,
                                         H* __restrict__ hout = nullptr) {
  static_assert(!ADD || !(STAGE || EARLY_PARAMS || FULL), "fused add: direct rows only");
  static_assert(CL == 1 || !(EARLY_PARAMS || FULL), "clusters: parameters late, columns tested");
  typedef typename Acc<T>::type C;
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
      chunk_stats<CHUNKED, LN, WARP, VEC, NPT, FULL, 0, CL>(p, c * span, t0, N, span, phase,
                                                            inv_n, n, mean, m2);
    }
    const C mu = LN ? mean : C(0);
    const C rstd = cl_rsqrt(m2 * inv_n + eps);
    if (valid && threadIdx.x == 0) {
      if (LN) mean_out[row] = (float)mu;
      rstd_out[row] = (float)rstd;
    }
    for (int c = 0; c < nchunks && valid; ++c) {
      const cl_i64 t0 = c * span + tile;
      if constexpr (CHUNKED && ADD) {  // read again: h, as this thread stored it
        load_row<VEC, NPT>(hout + row * N, t0, N, valid, p);
      } else if constexpr (CHUNKED) {
        load_row<VEC, NPT>(xr, t0, N, valid, p);
      }
      write_chunk<EARLY, VEC, NPT, FULL>(p, (int)t0, (int)N, mu, rstd, gamma, beta, y + row * N,
                                        hg, hb);
    }
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

template <typename T, typename W, bool LN, int VEC, int NPT, int WARP, bool STAGE, bool EARLY,
          bool FULL>
__global__ void __launch_bounds__(1024) norm_fwd(CLN_FWD_PARAMS) {
  fwd_rows<false, STAGE, EARLY, T, W, LN, VEC, NPT, WARP, FULL>(CLN_FWD_ARGS);
}

// Rows longer than one chunk: 4 vectors per thread (the planner's choice for long rows).
template <typename T, typename W, bool LN, int VEC, int WARP>
__global__ void __launch_bounds__(1024) norm_fwd_chunked(CLN_FWD_PARAMS) {
  fwd_rows<true, false, false, T, W, LN, VEC, 4, WARP>(CLN_FWD_ARGS);
}

// The fused residual add (fwd_rows' ADD), h in H: rows of one chunk, NPT vectors per thread,
// and longer rows in chunks. Built for 16-byte vectors and single elements only (the planner's
// rule): intermediate widths would double the specializations for rare alignments.
#define CLN_FWD_ADD_PARAMS \
  CLN_FWD_PARAMS, const H *__restrict__ res, cl_i64 ldr, H *__restrict__ hout
template <typename T, typename W, typename H, bool LN, int VEC, int NPT, int WARP>
__global__ void __launch_bounds__(1024) norm_fwd_add(CLN_FWD_ADD_PARAMS) {
  fwd_rows<false, false, false, T, W, LN, VEC, NPT, WARP, false, H, true>(CLN_FWD_ARGS, res, ldr,
                                                                          hout);
}

template <typename T, typename W, typename H, bool LN, int VEC, int WARP>
__global__ void __launch_bounds__(1024) norm_fwd_add_chunked(CLN_FWD_ADD_PARAMS) {
  fwd_rows<true, false, false, T, W, LN, VEC, 4, WARP, false, H, true>(CLN_FWD_ARGS, res, ldr,
                                                                       hout);
}

// Rows split over the CL blocks of a cluster (sm_90; the planner's choice for rows longer than
// one block holds): x read once where the row fits in the cluster's registers (CHUNKED = false),
// else in chunks spanning the cluster, read twice. STAGE (one chunk): resident clusters loop
// over rows, each block copying its part of the next row into shared memory while it reduces
// this one, so the exchanges' latency overlaps the loads. Built for 16-byte vectors, as the fused
// add's (norm_fwd_add_cluster, direct).
template <typename T, typename W, bool LN, int VEC, int NPT, int WARP, int CL, bool CHUNKED,
          bool STAGE = false>
__global__ void __launch_bounds__(1024)
CLN_CLUSTER_DIMS(1, CL, 1) norm_fwd_cluster(CLN_FWD_PARAMS) {
  fwd_rows<CHUNKED, STAGE, false, T, W, LN, VEC, NPT, WARP, false, T, false, CL>(CLN_FWD_ARGS);
}

template <typename T, typename W, typename H, bool LN, int VEC, int NPT, int WARP, int CL,
          bool CHUNKED>
__global__ void __launch_bounds__(1024)
CLN_CLUSTER_DIMS(1, CL, 1) norm_fwd_add_cluster(CLN_FWD_ADD_PARAMS) {
  fwd_rows<CHUNKED, false, false, T, W, LN, VEC, NPT, WARP, false, H, true, CL>(CLN_FWD_ARGS, res,
                                                                              ldr, hout);
}

// Rows of one chunk in 16-byte vectors, NPT per thread (the planner's choice: one vector for
// small M in at most fwd.row_warps whole warps, one row per block, or for rows of at most a
// warp, blockDim.y of them per block, whatever M; fwd.npt vectors for rows of 2 to
// fwd.row_npt_warps whole warps, one row per block, whatever M): the row's threads fixed at
// compile time, no row loop, and the loads of gamma, beta and x issued first, together. The
// trap's branch after them ends the block of code they are in: without it ptxas scheduled
// gamma's and beta's loads after the row's first reduction, next to their use, so their memory
// trip followed x's instead of overlapping it (SASS, nvcc 13.0 sm_90). The launch must be TPR x
// blockDim.y threads (one row per block where TPR is more than a warp) in a grid of exactly
// ceil(M / blockDim.y) blocks. y's offsets are 32-bit: the planner takes this kernel only where
// M * N < 2^31.
template <typename T, typename W, bool LN, int VEC, int WARP, int TPR, bool FULL, int NPT = 1>
__global__ void __launch_bounds__(TPR > WARP ? TPR : 1024) norm_fwd_row(CLN_FWD_PARAMS) {
  typedef typename Acc<T>::type C;
  constexpr bool MANY = TPR <= WARP;  // rows stacked in blockDim.y, the last block partly past M
  const unsigned int row = MANY ? blockIdx.x * blockDim.y + threadIdx.y : blockIdx.x;
  const bool valid = !MANY || row < M;
  typename Held<W, VEC>::type hg[NPT], hb[NPT];
  Pack<T, VEC> raw[NPT];
  load_packs<VEC, NPT, FULL>(gamma, 0, N, gamma != nullptr, hg);
  load_packs<VEC, NPT, FULL>(beta, 0, N, beta != nullptr, hb);
  load_packs<VEC, NPT, FULL>(x + (cl_i64)(valid ? row : 0) * ldx, 0, N, valid, raw);
  const cl_i64 rows = blockDim.y;
  const bool grid_ok = MANY ? gridDim.x * rows >= M && (gridDim.x - 1) * rows < M
                            : blockDim.y == 1 && (cl_i64)gridDim.x == M;
  if ((int)blockDim.x != TPR || !grid_ok) cl_trap();
  typename RowVec<T, VEC>::type p[NPT];
#pragma unroll
  for (int k = 0; k < NPT; ++k) to_row(raw[k], p[k]);
  const C inv_n = cl_inv_count(C(0), N);
  C n = C(0), mean = C(0), m2 = C(0);
  chunk_stats<false, LN, WARP, VEC, NPT, FULL, TPR, 1>(p, 0, 0, N, (cl_i64)TPR * NPT * VEC, 0,
                                                       inv_n, n, mean, m2);
  const C mu = LN ? mean : C(0);
  const C rstd = cl_rsqrt(m2 * inv_n + eps);
  if (!valid) return;  // after the row's reductions, which take every thread of the block
  if (threadIdx.x == 0) {
    if (LN) mean_out[row] = (float)mu;
    rstd_out[row] = (float)rstd;
  }
  // one code path for the output: 0.03-0.13 us faster than the four cases
  write_chunk<true, VEC, NPT, FULL, true>(p, 0, (int)N, mu, rstd, gamma, beta,
                                          y + row * (int)N, hg, hb);
}

// Backward pass of LayerNorm (LN = true) and RMSNorm (LN = false), one template family.
//
//   xhat = (x - mean) * rstd  (RMSNorm: x * rstd),  g = dy * gamma
//   dx = rstd * (g - mean(g) - xhat * mean(g * xhat)) + dres   (RMSNorm: no mean(g) term;
//   dres, the fused residual add's gradient from the residual stream, in its own kernels)
//   dgamma = sum_rows(dy * xhat),  dbeta = sum_rows(dy)
//
// norm_bwd reads x and dy once: it computes dx row by row and, in the same pass, accumulates the
// dgamma/dbeta partial sums of its rows in registers. At the end each block either adds its
// partials into a zeroed 2N-vector with atomicAdd (the last block to finish casts that vector
// into dgamma/dbeta and zeroes it for the next launch: one kernel), or writes them to its own
// row of a [blocks, 2N] scratch that norm_bwd_reduce sums in a fixed order (deterministic); a
// grid of few blocks sums those rows itself, in its last block, in the same order (one kernel).
// Rows that fit in the blocks of one cluster at once (sm_90) run there instead (norm_bwd_csum):
// the blocks sum dgamma/dbeta among themselves through distributed shared memory, in a fixed
// order, with no scratch.
// The DYN kernel (staged blocks, given a zeroed row ticket counter `tickets`; the host's choice
// where dgamma/dbeta need not be bitwise repeatable) takes its rows dynamically, so a fast block
// takes more rows than a slow one; otherwise block b takes rows b, b + G, ... (bwd_rows).
// Rows too long for registers run on column tiles (gridDim.y > 1): on sm_90 in clusters of
// blocks that exchange their tiles' row sums (norm_bwd_cluster: x and dy read once), elsewhere
// after norm_bwd_rowsums has computed each row's two sums (x and dy read twice). Where blocks loop
// over rows, the staged variant (STAGE, CUDA sm_80 on) copies each block's next row into shared
// memory while it reduces this one, so the row's loads stay in flight through its reductions.

// The flush policy of bwd_rows, after its rows: each block's dgamma/dbeta sums (acc_g, acc_b:
// this thread's columns from c0) leave the block, to their owners in one cluster (XC > 1,
// ClusterSums, whose owners then write dgamma/dbeta), to this block's row of partials (summed
// by norm_bwd_reduce, or here by the last block where LAST), or by float32 atomics into `accum`
// (the last block casts and zeroes them).
template <typename W, int VEC, int NPT, int XC, bool LAST, typename C, typename CS>
__device__ __forceinline__ void flush_params(const C (&acc_g)[NPT][VEC],
                                             const C (&acc_b)[NPT][VEC], CS& csum, cl_i64 c0,
                                             cl_i64 N, W* __restrict__ dgamma,
                                             W* __restrict__ dbeta, C* __restrict__ accum,
                                             unsigned int* __restrict__ counter,
                                             C* __restrict__ partial) {
  extern __shared__ __align__(16) unsigned char cl_smem[];
  const bool want_g = dgamma != nullptr, want_b = dbeta != nullptr;
  const int t = threadIdx.x;
  const int threads = blockDim.x * blockDim.y;
  const int tid = threadIdx.y * blockDim.x + t;
  if (!want_g && !want_b) return;  // uniform: no barrier below is skipped by part of a block
  C* buf = reinterpret_cast<C*>(cl_smem) + (XC > 1 ? XC * csum.per : 0);
  C* prow = partial ? partial + (cl_i64)blockIdx.x * 2 * N : nullptr;  // this block's partials
#pragma unroll
  for (int k = 0; k < NPT; ++k) {
    const cl_i64 base = c0 + (cl_i64)k * blockDim.x * VEC;  // first column of vector k
    if (blockDim.y == 1) {
      // one row per block: the thread's own columns, partials as one vector store each
      // (scattered scalar stores had cost the N = 8192 backwards 15-30%)
      const cl_i64 col = base + (cl_i64)t * VEC;
      if (col >= N) continue;
      if constexpr (XC > 1) {
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          if (want_g) csum.send(col + j, acc_g[k][j]);
          if (want_b) csum.send(N + col + j, acc_b[k][j]);
        }
      } else if (partial) {
        if (want_g) store_vec<VEC>(prow + col, acc_g[k]);
        if (want_b) store_vec<VEC>(prow + N + col, acc_b[k]);
      } else {
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          if (want_g) atomicAdd(accum + col + j, acc_g[k][j]);
          if (want_b) atomicAdd(accum + N + col + j, acc_b[k][j]);
        }
      }
      continue;
    }
    // several rows: summed over the block's rows first (uniform branch: every thread is here)
    auto flush_to = [&](cl_i64 off) {
      return [&, off](int c, C s) {
        const cl_i64 col = base + c;
        if (col >= N) return;
        if constexpr (XC > 1) csum.send(off + col, s);
        else if (partial) prow[off + col] = s;
        else atomicAdd(accum + off + col, s);
      };
    };
    if (want_g) block_column_sums<VEC>(acc_g[k], buf, flush_to(0));
    if (want_b) block_column_sums<VEC>(acc_b[k], buf, flush_to(N));
  }
  if constexpr (XC > 1) {
    csum.finish(2 * N, [&](cl_i64 c, C s) {
      if (c < N) {
        if (want_g) dgamma[c] = Store<W>::cvt(s);
      } else if (want_b) {
        dbeta[c - N] = Store<W>::cvt(s);
      }
    });
    return;
  }
  // Only the LAST variant has the last-block sums: compiled into the other kernels that code
  // had cost the staged LayerNorm kernel 8% at 131072x4096 bf16.
  if (partial && !(LAST && counter)) return;  // summed by norm_bwd_reduce

  // The last block to finish (a ticket counter) writes dgamma/dbeta: with partials (a grid of
  // few blocks, the host's choice) it sums every block's row as norm_bwd_reduce would; with the
  // atomic flush it casts the sums and zeroes them again. The ticket wraps back to 0 after the
  // last block, so the counter and the accumulators are ready for the next launch without a
  // memset.
  __shared__ bool is_last;
  __threadfence();
  __syncthreads();
  const unsigned int blocks = gridDim.x * gridDim.y;
  if (tid == 0) is_last = atomicInc(counter, blocks - 1) == blocks - 1;
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  if (LAST && partial) {
#pragma unroll 4
    for (cl_i64 c = tid; c < 2 * N; c += threads) {
      const bool is_g = c < N;
      if (!(is_g ? want_g : want_b)) continue;
      C s[8], tot = C(0);
      partial_groups<8, true>(partial + c, 0, gridDim.x, 2 * N, s);
#pragma unroll
      for (int r = 0; r < 8; ++r) tot += s[r];
      if (is_g) dgamma[c] = Store<W>::cvt(tot);
      else dbeta[c - N] = Store<W>::cvt(tot);
    }
    return;
  }
  volatile C* acc = accum;
  for (cl_i64 c = tid; c < 2 * N; c += (cl_i64)blockDim.x * blockDim.y) {
    const bool is_g = c < N;  // [0, N): dgamma, [N, 2N): dbeta
    if (!(is_g ? want_g : want_b)) continue;
    const C s = acc[c];
    acc[c] = C(0);
    if (is_g) dgamma[c] = Store<W>::cvt(s);
    else dbeta[c - N] = Store<W>::cvt(s);
  }
}

// One vector per thread fits 1024-thread blocks in 64 registers; two need up to 128: the
// backward kernels' launch bound (the host's _bwd_threads).
__host__ __device__ constexpr int bwd_max_threads(int npt) { return npt == 1 ? 1024 : 512; }

// The per-element work is kept to the arithmetic itself (SASS of the H200 build: 44
// instructions per element before): 16-bit rows converted from 32-bit words, no per-element
// bounds selects (an out-of-range vector loads as zeros: dy = 0 and gamma = 0 there, so it adds
// nothing), gamma held across rows where it fits, dx by two fused multiply-adds, one 16-byte
// store per vector.
#define CLN_BWD_PARAMS                                                                        \
  const T *__restrict__ dy, cl_i64 lddy, const T *__restrict__ x, cl_i64 ldx,                \
      const W *__restrict__ gamma, const float *__restrict__ mean,                           \
      const float *__restrict__ rstd, const typename Acc<T>::type *__restrict__ rowsums,     \
      T *__restrict__ dx, W *__restrict__ dgamma, W *__restrict__ dbeta,                     \
      typename Acc<T>::type *__restrict__ accum, unsigned int *__restrict__ counter,          \
      unsigned int *__restrict__ tickets, typename Acc<T>::type *__restrict__ partial,        \
      cl_i64 M, cl_i64 N, const T *__restrict__ dres, cl_i64 ldres
#define CLN_BWD_ARGS \
  dy, lddy, x, ldx, gamma, mean, rstd, rowsums, dx, dgamma, dbeta, accum, counter, tickets, \
      partial, M, N, dres, ldres

// CL > 1: the blocks of a cluster of CL (gridDim.y == CL) split each row into CL column tiles
// and add their row sums through the cluster (cluster_allreduce); rowsums is then NULL.
// LAST: the last block sums the partials of a grid of few blocks (see below).
// DYN: staged rows from `tickets` (its own argument, apart from the flush's `counter`), see
// below.
// XC > 1: the grid is one cluster of XC blocks (gridDim.x == XC), which sum dgamma/dbeta through
// distributed shared memory (ClusterSums); partial, accum and counter are then unused.
// ADD: the fused residual add's backward, dres (row stride ldres) added to dx; a compile-time
// choice, so the other kernels keep their registers and instructions.
template <typename T, typename W, bool LN, int VEC, int NPT, int WARP, bool STAGE, int CL,
          bool LAST, int XC = 1, bool DYN = false, bool ADD = false>
__device__ __forceinline__ void bwd_rows(CLN_BWD_PARAMS) {
  static_assert(XC == 1 || (CL == 1 && !STAGE && !LAST), "cluster sums: direct rows only");
  typedef typename Acc<T>::type C;
  typedef Pack<T, VEC> P;
  // one cluster per row (the config's cluster_tiles), a row of whole warps per block (the
  // exchange's slots: CL times the launch bound's warps)
  constexpr int CSLOTS = cluster_slots<CL, WARP, bwd_max_threads(NPT)>();
  if constexpr (CL > 1) cluster_rows_init<CL, WARP, CSLOTS, 2, C>();
  // one cluster in all (two would each write dgamma/dbeta from their own rows only)
  if (XC > 1 && (gridDim.x != XC || gridDim.y != 1)) cl_trap();
  // Staged rows (STAGE; see below), and DYN: the staged rows from tickets (see the loop)
  constexpr bool STAGED = STAGE && CLN_ASYNC_COPY && sizeof(P) >= 4;
  constexpr bool DYNAMIC = DYN && STAGED && CL == 1 && XC == 1;
  typedef typename Held<W, VEC>::type G;
  // Staged rows (STAGE; stage_packs): the next row's x and dy are copied into shared memory
  // while this one is reduced, in two buffers of [x, dy][NPT][threads] packs; gamma once per
  // block after them, [NPT][blockDim.x]. The host gives the dynamic shared memory for it
  // (cupyln/_plan.py); a launch with less traps. A compile-time choice: the two paths in one kernel
  // (chosen by the launch's shared memory) made both slower (131072x4096 bf16: 24% slower than
  // staged; ptxas spilled in the loop).
  // Unstaged, gamma is held in registers across rows where ptxas still fits the kernel in 64
  // registers without spilling (sm_90: one 16-byte vector per thread, LayerNorm only)
  constexpr bool HOLD_GAMMA = !STAGED && NPT == 1 && sizeof(W) * VEC <= 16 && LN;
  extern __shared__ __align__(16) unsigned char cl_smem[];
  const int t = threadIdx.x;
  const C inv_n = cl_inv_count(C(0), N);
  const cl_i64 c0 = (cl_i64)blockIdx.y * blockDim.x * NPT * VEC;  // this block's column tile
  const bool want_g = dgamma != nullptr, want_b = dbeta != nullptr;
  // Cluster sums: the received values first in the dynamic shared memory, then the column sums'
  // buffer (both sized by the host).
  ClusterSums<XC, C> csum;
  if constexpr (XC > 1) {
    __shared__ unsigned long long csum_bar;
    csum.init(reinterpret_cast<C*>(cl_smem), 2 * N, &csum_bar, [&](const auto& cs) {
      return (want_g ? cs.owned(0, N) : 0) + (want_b ? cs.owned(N, 2 * N) : 0);
    });
    require_dynamic_smem((XC * csum.per + (blockDim.y > 1 ? blockDim.x * blockDim.y * VEC : 0)) *
                         sizeof(C));
  }
  C acc_g[NPT][VEC], acc_b[NPT][VEC];
#pragma unroll
  for (int k = 0; k < NPT; ++k)
#pragma unroll
    for (int j = 0; j < VEC; ++j) acc_g[k][j] = acc_b[k][j] = C(0);
  G gp[NPT];  // gamma of this thread's columns (zero past N)
  const int threads = blockDim.x * blockDim.y;
  const int tid = threadIdx.y * blockDim.x + t;
  P* stage = reinterpret_cast<P*>(cl_smem);
  G* gstage = reinterpret_cast<G*>(stage + 4 * NPT * threads);
  if constexpr (STAGED) {
    require_dynamic_smem(4u * NPT * threads * sizeof(P) + NPT * blockDim.x * sizeof(G));
    if (gamma) stage_packs<VEC, NPT, true>(gstage, gamma, c0, N, true);  // in row 0's group
  }
  if (HOLD_GAMMA && gamma) load_packs<VEC, NPT>(gamma, c0, N, true, gp);
  const cl_i64 step = (cl_i64)gridDim.x * blockDim.y;
  // The statistics of row `row` (zeros past M: xhat = 0 there, nothing accumulates).
  auto stats = [&](cl_i64 row, C& mu, C& rs) {
    const bool ok = row < M;
    const cl_i64 r = ok ? row : 0;
    mu = (LN && ok) ? (C)mean[r] : C(0);
    rs = ok ? (C)rstd[r] : C(0);
  };
  // Staged: issues row `row`'s copies into buffer `b` (zeros past M) and loads its statistics
  // ahead too (loaded in the iteration, they stalled every row: 15% slower at
  // 131072x4096 bf16). The direct path loads both in the iteration (a prefetch there
  // made ptxas spill).
  auto prefetch = [&](cl_i64 row, int b, C& mu, C& rs) {
    if constexpr (STAGED) {
      const bool ok = row < M;
      const cl_i64 r = ok ? row : 0;
      P* d = stage + b * 2 * NPT * threads;
      stage_packs<VEC, NPT>(d, x + r * ldx, c0, N, ok);
      stage_packs<VEC, NPT>(d + NPT * threads, dy + r * lddy, c0, N, ok);
      async_commit();
      stats(row, mu, rs);
    }
  };
  C mu_next, rs_next;
  prefetch((cl_i64)blockIdx.x * blockDim.y + threadIdx.y, 0, mu_next, rs_next);
  // DYN: staged rows from tickets (RowTickets; the host's variant for deterministic=False, with
  // rows wider than a warp, whose reductions have a block barrier, and one column tile: one
  // counter serves one set of rows). A kernel of its own: the static kernels keep their
  // registers (with both in one, the static path ran up to 10% slower); tickets are 3.5% faster
  // at 131072x4096 bf16.
  if (DYNAMIC && (tickets == nullptr || blockDim.x <= WARP || gridDim.y != 1)) cl_trap();
  RowTickets rt(tickets, (unsigned int)((M + blockDim.y - 1) / blockDim.y));  // < 2^31 groups
  unsigned int* btick = nullptr;  // the hand-on: two slots, alternating by row
  if constexpr (DYNAMIC) {  // (no shared memory in the static kernels)
    __shared__ unsigned int slots[2];
    btick = slots;
  }
  int phase = 0;
  for (cl_i64 base = (cl_i64)blockIdx.x * blockDim.y; base < M; ++phase) {
    const cl_i64 row = base + threadIdx.y;
    const bool valid = row < M;
    C mu, rs;
    if constexpr (STAGED) {
      mu = mu_next;
      rs = rs_next;
      prefetch(DYNAMIC ? (cl_i64)rt.nxt * blockDim.y + threadIdx.y : row + step,
               (phase + 1) & 1, mu_next, rs_next);
      // a slot is written again two rows later, after the barrier every thread passes once it
      // has read it
      if (DYNAMIC && tid == 0) btick[phase & 1] = rt.take();
    } else {
      stats(row, mu, rs);
    }
    C xh[NPT][VEC], g[NPT][VEC];  // g: dy, then dy * gamma
    {
      P px[NPT], pdy[NPT];
      if constexpr (STAGED) {
        async_wait<1>();  // this row's group has landed; the next row's stays in flight
        if (phase == 0) __syncthreads();  // gamma, copied by row 0's threads, for every row
        const P* src = stage + (phase & 1) * 2 * NPT * threads + tid;
#pragma unroll
        for (int k = 0; k < NPT; ++k) {
          px[k] = src[k * threads];
          pdy[k] = src[(NPT + k) * threads];
        }
      } else {
        const cl_i64 r = valid ? row : 0;
        load_packs<VEC, NPT>(x + r * ldx, c0, N, valid, px);
        load_packs<VEC, NPT>(dy + r * lddy, c0, N, valid, pdy);
      }
#pragma unroll
      for (int k = 0; k < NPT; ++k) {
        // x loads as 0 past N: with mean 0 there xhat stays 0 (x - mean could overflow)
        const C mk = c0 + ((cl_i64)k * blockDim.x + t) * VEC < N ? mu : C(0);
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          g[k][j] = (C)elem(pdy[k], j);
          xh[k][j] = ((C)elem(px[k], j) - mk) * rs;
          acc_g[k][j] = cl_fma(g[k][j], xh[k][j], acc_g[k][j]);
          acc_b[k][j] += g[k][j];
        }
      }
    }
    if (gamma) {
      if constexpr (STAGED) {
#pragma unroll
        for (int k = 0; k < NPT; ++k) gp[k] = gstage[k * blockDim.x + t];
      } else if (!HOLD_GAMMA) {
        load_packs<VEC, NPT>(gamma, c0, N, true, gp);
      }
#pragma unroll
      for (int k = 0; k < NPT; ++k)
#pragma unroll
        for (int j = 0; j < VEC; ++j) g[k][j] *= (C)elem(gp[k], j);
    }
    C s[2] = {C(0), C(0)};
#pragma unroll
    for (int k = 0; k < NPT; ++k)
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        s[0] += g[k][j];
        s[1] = cl_fma(g[k][j], xh[k][j], s[1]);
      }
    if (rowsums) {  // long rows: the sums come from norm_bwd_rowsums
      s[0] = valid ? rowsums[2 * row] : C(0);
      s[1] = valid ? rowsums[2 * row + 1] : C(0);
    } else if constexpr (CL > 1) {
      cluster_allreduce<CL, CSLOTS, WARP>(s, phase);  // the row's warps in all tiles
    } else {
      row_allreduce<WARP>(s, phase);
    }
    if (dx && valid) {
      // dx = rs * (g - mean(g) - xhat * mean(g * xhat)) = g * rs - (xhat * a + b)
      const C a = rs * (s[1] * inv_n);
      const C b = LN ? rs * (s[0] * inv_n) : C(0);
      T* dxr = dx + row * N;
#pragma unroll
      for (int k = 0; k < NPT; ++k) {
        const cl_i64 col = c0 + ((cl_i64)k * blockDim.x + t) * VEC;
        if (col >= N) continue;
        C o[VEC];
#pragma unroll
        for (int j = 0; j < VEC; ++j) o[j] = g[k][j] * rs - (xh[k][j] * a + b);
        if constexpr (ADD) {  // the fused residual add's gradient from the residual stream
          const Pack<T, VEC> r = *reinterpret_cast<const Pack<T, VEC>*>(dres + row * ldres + col);
#pragma unroll
          for (int j = 0; j < VEC; ++j) o[j] += (C)elem(r, j);
        }
        store_vec<VEC>(dxr + col, o);
      }
    }
    if constexpr (DYNAMIC) {  // after the row's reduction barrier: thread 0's group
      base = (cl_i64)rt.advance(btick[phase & 1]) * blockDim.y;
    } else {
      base += step;
    }
  }

  async_wait<0>();  // the copies past the last row (zeros) land before the memory is reused
  // a cluster's blocks leave together: none exits while its last row's sums may still be on
  // their way into another block's shared memory
  if constexpr (CL > 1) cluster_sync();
  if constexpr (XC > 1) csum.ready();
  flush_params<W, VEC, NPT, XC, LAST>(acc_g, acc_b, csum, c0, N, dgamma, dbeta, accum, counter,
                                      partial);
}

// LAST (direct rows only): a grid of few blocks whose last block sums their partials, in
// norm_bwd_reduce's order (the planner's choice where that costs less than a second launch).
template <typename T, typename W, bool LN, int VEC, int NPT, int WARP, bool STAGE, bool LAST,
          bool DYN = false>
__global__ void __launch_bounds__(bwd_max_threads(NPT)) norm_bwd(CLN_BWD_PARAMS) {
  static_assert(!(STAGE && LAST), "the last-block sums are for direct rows");
  bwd_rows<T, W, LN, VEC, NPT, WARP, STAGE, 1, LAST, 1, DYN>(CLN_BWD_ARGS);
}

// The fused residual add's backward (bwd_rows' ADD): rows within a block or column tiles, direct
// or staged, and long rows in clusters of CL column tiles (direct, 16-byte vectors). Built for
// 16-byte vectors and single elements only, as the fused forward.
template <typename T, typename W, bool LN, int VEC, int NPT, int WARP, bool STAGE, bool LAST>
__global__ void __launch_bounds__(bwd_max_threads(NPT)) norm_bwd_add(CLN_BWD_PARAMS) {
  static_assert(!(STAGE && LAST), "the last-block sums are for direct rows");
  bwd_rows<T, W, LN, VEC, NPT, WARP, STAGE, 1, LAST, 1, false, true>(CLN_BWD_ARGS);
}

template <typename T, typename W, bool LN, int VEC, int NPT, int WARP, int CL>
__global__ void __launch_bounds__(bwd_max_threads(NPT))
CLN_CLUSTER_DIMS(1, CL, 1) norm_bwd_add_cluster(CLN_BWD_PARAMS) {
  bwd_rows<T, W, LN, VEC, NPT, WARP, false, CL, false, 1, false, true>(CLN_BWD_ARGS);
}

// A grid of one cluster of XC blocks that sum dgamma/dbeta in it (sm_90 on; the planner's choice
// where the rows fit in its blocks at once: bwd.cluster_sums).
template <typename T, typename W, bool LN, int VEC, int NPT, int WARP, int XC>
__global__ void __launch_bounds__(bwd_max_threads(NPT))
CLN_CLUSTER_DIMS(XC, 1, 1) norm_bwd_csum(CLN_BWD_PARAMS) {
  bwd_rows<T, W, LN, VEC, NPT, WARP, false, 1, false, XC>(CLN_BWD_ARGS);
}

// Long rows in clusters of CL column tiles (the planner's choice on sm_90 where a row fits in
// that many blocks; CL is bwd.cluster_tiles); elsewhere norm_bwd_rowsums, then norm_bwd on
// column tiles.
template <typename T, typename W, bool LN, int VEC, int NPT, int WARP, bool STAGE, int CL>
__global__ void __launch_bounds__(bwd_max_threads(NPT))
CLN_CLUSTER_DIMS(1, CL, 1) norm_bwd_cluster(CLN_BWD_PARAMS) {
  bwd_rows<T, W, LN, VEC, NPT, WARP, STAGE, CL, false>(CLN_BWD_ARGS);
}

// The two row sums of dx, sum(g) and sum(g * xhat), for rows longer than norm_bwd's registers
// hold: one row per block (blockDim.y == 1), the row read in chunks of blockDim.x * NPT * VEC;
// CL > 1 (sm_90): one row per cluster of CL blocks (gridDim.y == CL), block r reading chunks r,
// r + CL, ..., their sums added through the cluster, so that few rows still keep CL SMs each
// streaming.
template <typename T, typename W, bool LN, int VEC, int NPT, int WARP, int CL = 1>
__global__ void __launch_bounds__(1024) CLN_CLUSTER_DIMS(1, CL, 1)
norm_bwd_rowsums(const T* __restrict__ dy, cl_i64 lddy, const T* __restrict__ x, cl_i64 ldx,
                 const W* __restrict__ gamma, const float* __restrict__ mean,
                 const float* __restrict__ rstd, typename Acc<T>::type* __restrict__ rowsums,
                 cl_i64 M, cl_i64 N) {
  typedef typename Acc<T>::type C;
  constexpr int SLOTS = cluster_slots<CL, WARP, 1024>();
  if constexpr (CL > 1) cluster_rows_init<CL, WARP, SLOTS, 2, C>();
  const cl_i64 chunk = (cl_i64)blockDim.x * NPT * VEC;
  const cl_i64 first = CL > 1 ? blockIdx.y * chunk : 0;
  int phase = 0;
  for (cl_i64 row = blockIdx.x; row < M; row += gridDim.x, ++phase) {
    const T* xr = x + row * ldx;
    const T* dyr = dy + row * lddy;
    const C mu = LN ? (C)mean[row] : C(0);
    const C rs = (C)rstd[row];
    C s[2] = {C(0), C(0)};
    for (cl_i64 c0 = first; c0 < N; c0 += CL * chunk) {
#pragma unroll
      for (int k = 0; k < NPT; ++k) {
        const cl_i64 col = c0 + ((cl_i64)k * blockDim.x + threadIdx.x) * VEC;
        if (col >= N) continue;
        C xv[VEC], dv[VEC], g[VEC];
        load_vec<VEC>(xr + col, xv);
        load_vec<VEC>(dyr + col, dv);
        if (gamma) {
          load_vec<VEC>(gamma + col, g);
        } else {
#pragma unroll
          for (int j = 0; j < VEC; ++j) g[j] = C(1);
        }
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          const C gj = g[j] * dv[j];
          s[0] += gj;
          s[1] += gj * ((xv[j] - mu) * rs);
        }
      }
    }
    if constexpr (CL > 1) cluster_allreduce<CL, SLOTS, WARP>(s, phase);
    else row_allreduce<WARP>(s, phase);
    if (threadIdx.x == 0 && (CL == 1 || blockIdx.y == 0)) {
      rowsums[2 * row] = s[0];
      rowsums[2 * row + 1] = s[1];
    }
  }
  if constexpr (CL > 1) cluster_sync();  // no block leaves while its sums are on their way
}

// Deterministic dgamma/dbeta: sum the [P, 2N] partials over P in a fixed order and cast.
// blockDim = (32, 8): 32 columns per block, one of partial_groups' eight groups per threadIdx.y,
// then the eight in order.
template <typename C, typename W>
__global__ void __launch_bounds__(256)
norm_bwd_reduce(const C* __restrict__ partial, cl_i64 P, cl_i64 N, W* __restrict__ dgamma,
                W* __restrict__ dbeta) {
  __shared__ C part[8][33];
  const cl_i64 col = (cl_i64)blockIdx.x * 32 + threadIdx.x;  // in [0, 2N)
  const bool is_g = col < N;
  W* out = is_g ? dgamma : dbeta;
  const bool active = col < 2 * N && out != nullptr;
  C s = C(0);
  if (active) {
    C g[1];
    partial_groups<1, false>(partial + col, threadIdx.y, P, 2 * N, g);
    s = g[0];
  }
  part[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && active) {
    C tot = C(0);
#pragma unroll
    for (int r = 0; r < 8; ++r) tot += part[r][threadIdx.x];
    out[is_g ? col : col - N] = Store<W>::cvt(tot);
  }
}
