// Backward pass of LayerNorm and RMSNorm, one kernel for both (common.cuh's is_ln: LayerNorm where
// the host gives the saved mean, `ln`), but the long rows' kernels in shared memory
// (norm_bwd_resident, norm_bwd_grid), whose norm is fixed: held together they spilled.
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
#include "bwd_common.cuh"

// The flush policy of bwd_rows, after its rows: each block's dgamma/dbeta sums (acc_g, acc_b:
// this thread's columns from c0) leave the block, to their owners in one cluster (XC > 1,
// ClusterSums, whose owners then write dgamma/dbeta), to this block's row of partials (summed
// by norm_bwd_reduce, or here by the last block where LAST), or by float32 atomics into `accum`
// (the last block casts and zeroes them), or, with neither (DIRECT: a grid of one row of blocks,
// so each block holds every row of its columns), straight to dgamma/dbeta.
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
      } else if (accum) {
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          if (want_g) atomicAdd(accum + col + j, acc_g[k][j]);
          if (want_b) atomicAdd(accum + N + col + j, acc_b[k][j]);
        }
      } else if (((size_t)dgamma | (size_t)dbeta) % sizeof(Pack<W, VEC>) == 0) {
        // the only block of these columns (DIRECT): its sums are dgamma/dbeta, stored as
        // vectors where both are aligned (per element, a long row's stores took longer than
        // its reads)
        if (want_g) store_vec<VEC>(dgamma + col, acc_g[k]);
        if (want_b) store_vec<VEC>(dbeta + col, acc_b[k]);
      } else {  // DIRECT, into dgamma/dbeta given unaligned (out=)
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          if (want_g) dgamma[col + j] = Store<W>::cvt(acc_g[k][j]);
          if (want_b) dbeta[col + j] = Store<W>::cvt(acc_b[k][j]);
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
        else if (accum) atomicAdd(accum + off + col, s);
        else (off ? dbeta : dgamma)[col] = Store<W>::cvt(s);  // DIRECT
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
  if (!partial && !accum) return;  // DIRECT: written above

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
template <typename T, typename W, int VEC, int NPT, int WARP, bool STAGE, int CL,
          bool LAST, int XC = 1, bool DYN = false, bool ADD = false>
__device__ __forceinline__ void bwd_rows(CLN_BWD_PARAMS) {
  static_assert(XC == 1 || (CL == 1 && !STAGE && !LAST), "cluster sums: direct rows only");
  typedef typename Acc<T>::type C;
  const bool ln = is_ln<cln::either_norm>(mean);
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
  // Staged rows (STAGE; stage_packs): the next row's x and dy (and dres, DRES_STAGED) are
  // copied into shared memory while this one is reduced, in two buffers of [x, dy(, dres)][NPT]
  // [threads] packs; gamma once per block after them, [NPT][blockDim.x]. The host gives the
  // dynamic shared memory for it (cupyln/_plan.py); a launch with less traps. A compile-time
  // choice: the two paths in one kernel (chosen by the launch's shared memory) made both slower
  // (131072x4096 bf16: 24% slower than staged; ptxas spilled in the loop).
  // Unstaged, gamma is held in registers across rows where ptxas still fits the kernel in 64
  // registers without spilling (sm_90: one 16-byte vector per thread), for LayerNorm: RMSNorm's
  // small backwards lost 3-4% so
  const bool hold_gamma = !STAGED && NPT == 1 && sizeof(W) * VEC <= 16 && ln;
  // ADD's dres: staged with x and dy at two or more vectors per thread, loaded with them on
  // direct rows, and at the dx store on staged rows of one vector per thread (staged there, it
  // lost). The host's staging_bytes agrees.
  constexpr bool DRES_STAGED = ADD && STAGED && NPT > 1;
  constexpr bool DRES_EARLY = DRES_STAGED || (ADD && !STAGED);
  constexpr int ROWS_IN = DRES_STAGED ? 3 : 2;  // the staged arrays of a row: x, dy (and dres)
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
  G* gstage = reinterpret_cast<G*>(stage + 2 * ROWS_IN * NPT * threads);
  if constexpr (STAGED) {
    require_dynamic_smem(2u * ROWS_IN * NPT * threads * sizeof(P) +
                         NPT * blockDim.x * sizeof(G));
    if (gamma) stage_packs<VEC, NPT, true>(gstage, gamma, c0, N, true);  // in row 0's group
  }
  if (hold_gamma && gamma) load_packs<VEC, NPT>(gamma, c0, N, true, gp);
  const cl_i64 step = (cl_i64)gridDim.x * blockDim.y;
  // The statistics of row `row` (zeros past M: xhat = 0 there, nothing accumulates).
  auto stats = [&](cl_i64 row, C& mu, C& rs) {
    const bool ok = row < M;
    const cl_i64 r = ok ? row : 0;
    mu = (ln && ok) ? (C)mean[r] : C(0);
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
      P* d = stage + b * ROWS_IN * NPT * threads;
      stage_packs<VEC, NPT>(d, x + r * ldx, c0, N, ok);
      stage_packs<VEC, NPT>(d + NPT * threads, dy + r * lddy, c0, N, ok);
      if constexpr (DRES_STAGED)
        stage_packs<VEC, NPT>(d + 2 * NPT * threads, dres + r * ldres, c0, N, ok);
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
    P pdr[DRES_EARLY ? NPT : 1];  // this row's dres (DRES_EARLY)
    {
      P px[NPT], pdy[NPT];
      if constexpr (STAGED) {
        async_wait<1>();  // this row's group has landed; the next row's stays in flight
        if (phase == 0) __syncthreads();  // gamma, copied by row 0's threads, for every row
        const P* src = stage + (phase & 1) * ROWS_IN * NPT * threads + tid;
#pragma unroll
        for (int k = 0; k < NPT; ++k) {
          px[k] = src[k * threads];
          pdy[k] = src[(NPT + k) * threads];
          if constexpr (DRES_STAGED) pdr[k] = src[(2 * NPT + k) * threads];
        }
      } else {
        const cl_i64 r = valid ? row : 0;
        load_packs<VEC, NPT>(x + r * ldx, c0, N, valid, px);
        load_packs<VEC, NPT>(dy + r * lddy, c0, N, valid, pdy);
        if constexpr (ADD) load_packs<VEC, NPT>(dres + r * ldres, c0, N, valid, pdr);
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
      } else if (!hold_gamma) {
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
      // DxRow's dx written out: through DxRow the compiled code of these kernels changed
      const C a = rs * (s[1] * inv_n);
      const C b = ln ? rs * (s[0] * inv_n) : C(0);
      T* dxr = dx + row * N;
#pragma unroll
      for (int k = 0; k < NPT; ++k) {
        const cl_i64 col = c0 + ((cl_i64)k * blockDim.x + t) * VEC;
        if (col >= N) continue;
        C o[VEC];
#pragma unroll
        for (int j = 0; j < VEC; ++j) o[j] = g[k][j] * rs - (xh[k][j] * a + b);
        if constexpr (ADD) {  // the fused residual add's gradient from the residual stream
          P r;
          if constexpr (DRES_EARLY) r = pdr[k];
          else r = *reinterpret_cast<const P*>(dres + row * ldres + col);
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

// The backward of rows peeled as norm_fwd_peeled peels them (x, dy and dx rows start alike
// within 16 bytes: the host's rule): one row per block at a time, block b taking rows b, b + G,
// ..., where the host makes G a multiple of the heads' period (VEC / gcd(N, VEC)) or covers M,
// so that all rows of a block have one head and each thread's dgamma/dbeta sums keep their
// columns. gamma is held in registers (peeled_params). The block's sums go to its row of
// partials ([G][2N], every column written), or, with none (DIRECT: one row of blocks), to
// dgamma/dbeta. TILES: rows longer than one block, on gridDim.y column tiles of the middle
// (blockDim.x * NPT vectors each), whose row sums norm_bwd_rowsums (peeled) has computed; tile 0
// also takes the head and tail. ADD: the fused add's dresidual (rows alike with x's, the host's
// rule), read with the row and added to dx.
template <typename T, typename W, int NPT, int WARP, bool TILES = false,
          bool ADD = false>
__global__ void __launch_bounds__(bwd_max_threads(NPT)) norm_bwd_peeled(CLN_BWD_PARAMS) {
  typedef typename Acc<T>::type C;
  const bool ln = is_ln<cln::either_norm>(mean);
  constexpr int VEC = 16 / (int)sizeof(T);
  const int t = threadIdx.x;
  const C inv_n = cl_inv_count(C(0), N);
  const int head = peel_head(x + blockIdx.x * ldx);
  const cl_i64 mid = (N - head) / VEC * VEC;  // the middle's elements, from column head
  const cl_i64 c0 = TILES ? (cl_i64)blockIdx.y * blockDim.x * NPT * VEC : 0;  // in the middle
  // this thread's peeled element: head element t, or tail element t - VEC
  const cl_i64 ec = t < VEC ? t : head + mid + (t - VEC);
  bool has_e = t < VEC ? t < head : t < 2 * VEC && ec < N;
  if constexpr (TILES) has_e = has_e && blockIdx.y == 0;  // tile 0's
  const C gamma_e = has_e && gamma ? to_acc(gamma[ec]) : C(1);
  // gamma of this thread's columns, held across the block's rows (they share the head)
  C gk[NPT][VEC];
#pragma unroll
  for (int k = 0; k < NPT; ++k) {
    const cl_i64 col = c0 + ((cl_i64)k * blockDim.x + t) * VEC;
#pragma unroll
    for (int j = 0; j < VEC; ++j) gk[k][j] = C(1);
    if (col < mid)
      peeled_params<VEC>(gamma, col, head, N, (size_t)gamma % (VEC * sizeof(W)) == 0, C(1),
                         gk[k]);
  }
  C acc_g[NPT][VEC], acc_b[NPT][VEC], eg = C(0), eb = C(0);
#pragma unroll
  for (int k = 0; k < NPT; ++k)
#pragma unroll
    for (int j = 0; j < VEC; ++j) acc_g[k][j] = acc_b[k][j] = C(0);
  int phase = 0;
  for (cl_i64 row = blockIdx.x; row < M; row += gridDim.x, ++phase) {
    const C mu = ln ? (C)mean[row] : C(0), rs = (C)rstd[row];
    Pack<T, VEC> px[NPT], pdy[NPT], pdr[ADD ? NPT : 1];
    load_packs<VEC, NPT>(x + row * ldx + head, c0, mid, true, px);
    load_packs<VEC, NPT>(dy + row * lddy + head, c0, mid, true, pdy);
    if constexpr (ADD) load_packs<VEC, NPT>(dres + row * ldres + head, c0, mid, !!dx, pdr);
    const C xe = has_e ? to_acc(x[row * ldx + ec]) : C(0);
    const C dye = has_e ? to_acc(dy[row * lddy + ec]) : C(0);
    const C dre = ADD && has_e && dx ? to_acc(dres[row * ldres + ec]) : C(0);
    C xh[NPT][VEC], g[NPT][VEC];  // g: dy, then dy * gamma
    C s[2] = {C(0), C(0)};
#pragma unroll
    for (int k = 0; k < NPT; ++k) {
      const cl_i64 col = c0 + ((cl_i64)k * blockDim.x + t) * VEC;
      const bool in = col < mid;
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        g[k][j] = (C)elem(pdy[k], j);
        xh[k][j] = in ? ((C)elem(px[k], j) - mu) * rs : C(0);
        acc_g[k][j] = cl_fma(g[k][j], xh[k][j], acc_g[k][j]);
        acc_b[k][j] += g[k][j];
        g[k][j] *= gk[k][j];
        if constexpr (!TILES) {
          s[0] += g[k][j];
          s[1] = cl_fma(g[k][j], xh[k][j], s[1]);
        }
      }
    }
    const C xhe = has_e ? (xe - mu) * rs : C(0);
    eg = cl_fma(dye, xhe, eg);
    eb += dye;
    const C ge = dye * gamma_e;
    if constexpr (TILES) {  // the row's sums, from norm_bwd_rowsums
      s[0] = rowsums[2 * row];
      s[1] = rowsums[2 * row + 1];
    } else {
      s[0] += ge;
      s[1] = cl_fma(ge, xhe, s[1]);
      row_allreduce<WARP>(s, phase);
    }
    if (!dx) continue;
    const DxRow<C> dxe(ln, rs, s, inv_n);
    T* dxr = dx + row * N;
#pragma unroll
    for (int k = 0; k < NPT; ++k) {
      const cl_i64 col = c0 + ((cl_i64)k * blockDim.x + t) * VEC;
      if (col >= mid) continue;
      C o[VEC];
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        o[j] = dxe(g[k][j], xh[k][j]);
        if constexpr (ADD) o[j] += (C)elem(pdr[k], j);
      }
      store_vec<VEC>(dxr + head + col, o);
    }
    if (has_e) dxr[ec] = Store<T>::cvt(ADD ? dxe(ge, xhe) + dre : dxe(ge, xhe));
  }
  // every column once: the middle's by its vectors' threads, the head's and tail's by theirs
  C* prow = partial ? partial + (cl_i64)blockIdx.x * 2 * N : nullptr;
  auto flush = [&](cl_i64 c, C sg, C sb) {
    if (prow) {
      if (dgamma) prow[c] = sg;
      if (dbeta) prow[N + c] = sb;
    } else {
      if (dgamma) dgamma[c] = Store<W>::cvt(sg);
      if (dbeta) dbeta[c] = Store<W>::cvt(sb);
    }
  };
#pragma unroll
  for (int k = 0; k < NPT; ++k) {
    const cl_i64 col = c0 + ((cl_i64)k * blockDim.x + t) * VEC;
    if (col >= mid) continue;
#pragma unroll
    for (int j = 0; j < VEC; ++j) flush(head + col + j, acc_g[k][j], acc_b[k][j]);
  }
  if (has_e) flush(ec, eg, eb);
}

// LAST (direct rows only): a grid of few blocks whose last block sums their partials, in
// norm_bwd_reduce's order (the planner's choice where that costs less than a second launch).
template <typename T, typename W, int VEC, int NPT, int WARP, bool STAGE, bool LAST,
          bool DYN = false>
__global__ void __launch_bounds__(bwd_max_threads(NPT)) norm_bwd(CLN_BWD_PARAMS) {
  static_assert(!(STAGE && LAST), "the last-block sums are for direct rows");
  bwd_rows<T, W, VEC, NPT, WARP, STAGE, 1, LAST, 1, DYN>(CLN_BWD_ARGS);
}

// The fused residual add's backward (bwd_rows' ADD): rows within a block or column tiles, direct
// or staged, and long rows in clusters of CL column tiles (direct or staged, 16-byte vectors).
// Built for 16-byte vectors and single elements only, as the fused forward.
template <typename T, typename W, int VEC, int NPT, int WARP, bool STAGE, bool LAST>
__global__ void __launch_bounds__(bwd_max_threads(NPT)) norm_bwd_add(CLN_BWD_PARAMS) {
  static_assert(!(STAGE && LAST), "the last-block sums are for direct rows");
  bwd_rows<T, W, VEC, NPT, WARP, STAGE, 1, LAST, 1, false, true>(CLN_BWD_ARGS);
}

template <typename T, typename W, int VEC, int NPT, int WARP, bool STAGE, int CL>
__global__ void __launch_bounds__(bwd_max_threads(NPT))
CLN_CLUSTER_DIMS(1, CL, 1) norm_bwd_add_cluster(CLN_BWD_PARAMS) {
  bwd_rows<T, W, VEC, NPT, WARP, STAGE, CL, false, 1, false, true>(CLN_BWD_ARGS);
}

// A grid of one cluster of XC blocks that sum dgamma/dbeta in it (sm_90 on; the planner's choice
// where the rows fit in its blocks at once: bwd.cluster_sums); ADD: the fused add's too.
template <typename T, typename W, int VEC, int NPT, int WARP, int XC, bool ADD = false>
__global__ void __launch_bounds__(bwd_max_threads(NPT))
CLN_CLUSTER_DIMS(XC, 1, 1) norm_bwd_csum(CLN_BWD_PARAMS) {
  bwd_rows<T, W, VEC, NPT, WARP, false, 1, false, XC, false, ADD>(CLN_BWD_ARGS);
}

// Long rows in clusters of CL column tiles (the planner's choice on sm_90 where a row fits in
// that many blocks; CL is bwd.cluster_tiles); elsewhere norm_bwd_rowsums, then norm_bwd on
// column tiles.
template <typename T, typename W, int VEC, int NPT, int WARP, bool STAGE, int CL>
__global__ void __launch_bounds__(bwd_max_threads(NPT))
CLN_CLUSTER_DIMS(1, CL, 1) norm_bwd_cluster(CLN_BWD_PARAMS) {
  bwd_rows<T, W, VEC, NPT, WARP, STAGE, CL, false>(CLN_BWD_ARGS);
}

// One row of NPT vectors per thread in shared memory (x and dy: px, pdy; gamma staged once in
// gstage, read where the kernel's gamma is not null), read twice from there by norm_bwd_grid:
// its two sums (s) with this thread's dgamma/dbeta terms added, then dx = g * rs - (xhat * a +
// b) as bwd_rows'. 16-bit LayerNorm reads one vector at a time (hoisted together, the loads
// spilled; RMSNorm and float32 lost a little so). norm_bwd_resident keeps the same passes
// inline: through these helpers ptxas spilled more there (16-bit: 16-24 bytes against 8-16).
template <typename T, int VEC, typename W, typename G, typename C,
          typename P = Pack<T, VEC>>
__device__ __forceinline__ void smem_row_vec(bool ln, const SmemRow<P>& px, const SmemRow<P>& pdy,
                                             const W* gamma, const G* gstage, int k, C mu,
                                             cl_i64 c0, cl_i64 N, P& xk, P& dk, G& gk, C& mk) {
  if (ln && sizeof(T) == 2 && k > 0) asm volatile("" ::: "memory");  // one at a time
  xk = px[k];
  dk = pdy[k];
  if (gamma) gk = gstage[k * px.stride + threadIdx.x];
  mk = c0 + ((cl_i64)k * px.stride + threadIdx.x) * VEC < N ? mu : C(0);  // x is 0 past N
}

template <int NPT, typename T, int VEC, typename W, typename G, typename C,
          typename P = Pack<T, VEC>>
__device__ __forceinline__ void smem_row_sums(bool ln, const SmemRow<Pack<T, VEC>>& px,
                                              const SmemRow<P>& pdy, const W* gamma,
                                              const G* gstage, C mu, C rs, cl_i64 c0, cl_i64 N,
                                              C (&acc_g)[NPT][VEC], C (&acc_b)[NPT][VEC],
                                              C (&s)[2]) {
  s[0] = s[1] = C(0);
#pragma unroll
  for (int k = 0; k < NPT; ++k) {
    P xk, dk;
    G gk;
    C mk;
    smem_row_vec<T, VEC>(ln, px, pdy, gamma, gstage, k, mu, c0, N, xk, dk, gk, mk);
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const C d = (C)elem(dk, j), xh = ((C)elem(xk, j) - mk) * rs;
      acc_g[k][j] = cl_fma(d, xh, acc_g[k][j]);
      acc_b[k][j] += d;
      const C g = gamma ? d * (C)elem(gk, j) : d;
      s[0] += g;
      s[1] = cl_fma(g, xh, s[1]);
    }
  }
}

// ADD: the fused residual add's dres row (pdr, in shared memory as x and dy) added to dx.
template <int NPT, bool ADD, typename T, int VEC, typename W, typename G, typename C,
          typename P = Pack<T, VEC>>
__device__ __forceinline__ void smem_row_dx(bool ln, const SmemRow<Pack<T, VEC>>& px,
                                            const SmemRow<P>& pdy, const SmemRow<P>& pdr,
                                            const W* gamma, const G* gstage, C mu, C rs, C inv_n,
                                            const C (&s)[2], cl_i64 c0, cl_i64 N, T* dxr) {
  const DxRow<C> dxe(ln, rs, s, inv_n);
#pragma unroll
  for (int k = 0; k < NPT; ++k) {
    const cl_i64 col = c0 + ((cl_i64)k * px.stride + threadIdx.x) * VEC;
    if (col >= N) continue;
    P xk, dk;
    G gk;
    C mk, o[VEC];
    smem_row_vec<T, VEC>(ln, px, pdy, gamma, gstage, k, mu, c0, N, xk, dk, gk, mk);
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const C xh = ((C)elem(xk, j) - mk) * rs;
      const C g = gamma ? (C)elem(dk, j) * (C)elem(gk, j) : (C)elem(dk, j);
      o[j] = dxe(g, xh);
    }
    if constexpr (ADD) {
      const P r = pdr[k];
#pragma unroll
      for (int j = 0; j < VEC; ++j) o[j] += (C)elem(r, j);
    }
    store_vec<VEC>(dxr + col, o);
  }
}

// Long rows whose x and dy stay in the shared memory of a cluster of CL column tiles (sm_90;
// the planner's choice for rows longer than the register tiles' clusters hold): blocks of up to
// 1024 threads of NPT vectors each, the next row's x and dy copied ahead (cp.async) into the
// second of two buffers, gamma staged once per thread. Both passes over a row (its sums with
// dgamma/dbeta, then dx) read it from shared memory, so that registers hold little more than
// the dgamma/dbeta sums; x and dy are read from memory once. Each thread reads only the slots
// it copied: no barrier. ADD: the fused residual add's dres added to dx, staged in one buffer
// when the row starts (cln::dresidual_staged, where the planner has room for it: none beside
// 1024 threads' x, dy and float32 gamma), else (cln::dresidual) fetched into L2 then and
// read from there. The flush is bwd_rows' (partials, atomics, or one row of blocks). Staged is
// known at compile time: decided at run time it spilled 8 bytes more, a flag whose reload
// queued behind the copies.
template <typename T, typename W, int NORM, int NPT, int WARP, int CL, int ADD = 0>
__global__ void __launch_bounds__(1024) CLN_CLUSTER_DIMS(1, CL, 1)
norm_bwd_resident(CLN_BWD_PARAMS) {
#if CLN_CLUSTERS && CLN_ASYNC_COPY
  typedef typename Acc<T>::type C;
  const bool ln = is_ln<NORM>(mean);
  const bool one_at_a_time = ln && sizeof(T) == 2;  // see smem_row_vec
  constexpr int VEC = 16 / (int)sizeof(T);
  typedef Pack<T, VEC> P;
  typedef typename Held<W, VEC>::type G;
  constexpr int CSLOTS = cluster_slots<CL, WARP, 1024>();
  cluster_rows_init<CL, WARP, CSLOTS, 2, C>();
  extern __shared__ __align__(16) unsigned char cl_smem[];
  const int t = threadIdx.x, threads = blockDim.x;
  P* stage = reinterpret_cast<P*>(cl_smem);
  G* gstage = reinterpret_cast<G*>(stage + 4 * NPT * threads);
  P* dstage = reinterpret_cast<P*>(gstage + NPT * threads);  // dres, where staged
  const unsigned int held = 4u * NPT * threads * sizeof(P) + NPT * threads * sizeof(G)
                            + (ADD == cln::dresidual_staged ? NPT * threads * sizeof(P) : 0u);
  require_dynamic_smem(held);
  // cln::dresidual keeps the run-time test (false as planned): without it ptxas spilled 40
  // bytes, not 8
  const bool dres_staged = ADD == cln::dresidual_staged
                           || (ADD && dynamic_smem_bytes() >= held + NPT * threads * sizeof(P));
  const cl_i64 c0 = (cl_i64)blockIdx.y * threads * NPT * VEC;  // this block's column tile
  const C inv_n = cl_inv_count(C(0), N);
  C acc_g[NPT][VEC], acc_b[NPT][VEC];
#pragma unroll
  for (int k = 0; k < NPT; ++k)
#pragma unroll
    for (int j = 0; j < VEC; ++j) acc_g[k][j] = acc_b[k][j] = C(0);
  if (gamma) stage_packs<VEC, NPT, true>(gstage, gamma, c0, N, true);  // in row 0's group
  auto prefetch = [&](cl_i64 row, int b) {  // row's x and dy into buffer b (zeros past M)
    const bool ok = row < M;
    const cl_i64 r = ok ? row : 0;
    P* d = stage + b * 2 * NPT * threads;
    stage_packs<VEC, NPT>(d, x + r * ldx, c0, N, ok);
    stage_packs<VEC, NPT>(d + NPT * threads, dy + r * lddy, c0, N, ok);
    async_commit();
  };
  prefetch(blockIdx.x, 0);
  int phase = 0;
  for (cl_i64 row = blockIdx.x; row < M; row += gridDim.x, ++phase) {
    const C mu = ln ? (C)mean[row] : C(0), rs = (C)rstd[row];
    if (dres_staged) {  // this row's dres, committed before the next row's x and dy
      stage_packs<VEC, NPT>(dstage, dres + row * ldres, c0, N, true);
      async_commit();
    }
    prefetch(row + gridDim.x, (phase + 1) & 1);
    // this row's copies have landed; the next row's (and this row's dres) stay in flight
    if (dres_staged)
      async_wait<2>();
    else
      async_wait<1>();
    const SmemRow<P> px{stage + (phase & 1) * 2 * NPT * threads + t, threads};
    const SmemRow<P> pdy{px.base + NPT * threads, threads};
    if (ADD && !dres_staged) {  // this row's dres into L2 while its sums are made
#pragma unroll
      for (int k = 0; k < NPT; ++k) {
        const cl_i64 col = c0 + ((cl_i64)k * threads + t) * VEC;
        if (col < N) prefetch_l2(dres + row * ldres + col);
      }
    }
    // vector k's x - mean (0 past N, where x is 0), dy and gamma, read from shared memory
    auto at = [&](int k, P& xk, P& dk, G& gk, C& mk) {
      xk = px[k];
      dk = pdy[k];
      if (gamma) gk = gstage[k * threads + t];
      mk = c0 + ((cl_i64)k * threads + t) * VEC < N ? mu : C(0);
    };
    C s[2] = {C(0), C(0)};
#pragma unroll
    for (int k = 0; k < NPT; ++k) {
      P xk, dk;
      G gk;
      C mk;
      // 16-bit LayerNorm: one vector's loads at a time (hoisted together, they spilled;
      // RMSNorm and float32 lost a little so)
      if (one_at_a_time && k > 0) asm volatile("" ::: "memory");
      at(k, xk, dk, gk, mk);
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const C d = (C)elem(dk, j), xh = ((C)elem(xk, j) - mk) * rs;
        acc_g[k][j] = cl_fma(d, xh, acc_g[k][j]);
        acc_b[k][j] += d;
        const C g = gamma ? d * (C)elem(gk, j) : d;
        s[0] += g;
        s[1] = cl_fma(g, xh, s[1]);
      }
    }
    cluster_allreduce<CL, CSLOTS, WARP>(s, phase);  // the row's warps in all tiles
    if (dx) {
      const DxRow<C> dxe(ln, rs, s, inv_n);
      T* dxr = dx + row * N;
      if (dres_staged) async_wait<1>();  // this row's dres has landed
#pragma unroll
      for (int k = 0; k < NPT; ++k) {
        const cl_i64 col = c0 + ((cl_i64)k * threads + t) * VEC;
        if (col >= N) continue;
        P xk, dk;
        G gk;
        C mk, o[VEC];
        if (one_at_a_time && k > 0) asm volatile("" ::: "memory");
        at(k, xk, dk, gk, mk);
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          const C xh = ((C)elem(xk, j) - mk) * rs;
          const C g = gamma ? (C)elem(dk, j) * (C)elem(gk, j) : (C)elem(dk, j);
          o[j] = dxe(g, xh);
        }
        if constexpr (ADD) {
          const P r = dres_staged ? dstage[k * threads + t]
                                  : *reinterpret_cast<const P*>(dres + row * ldres + col);
#pragma unroll
          for (int j = 0; j < VEC; ++j) o[j] += (C)elem(r, j);
        }
        store_vec<VEC>(dxr + col, o);
      }
    }
  }
  async_wait<0>();  // the copies past the last row (zeros) land before the block exits
  cluster_sync();   // none exits while its last row's sums may be on their way to another
  ClusterSums<1, C> none;
  flush_params<W, VEC, NPT, 1, false>(acc_g, acc_b, none, c0, N, dgamma, dbeta, accum, counter,
                                      partial);
#else
  cl_trap();  // the planner launches it only where clusters and cp.async exist
#endif
}

// Long rows on gridDim.y column tiles spread over the GPU, whose blocks add their tiles' row
// sums through global memory (GridRowSums): x and dy read once where no cluster holds the row.
// The host launches it cooperatively (every block resident at once) and gives the sums' zeroed
// area as `tickets`. Each block keeps NB rows of x and dy in shared memory (cp.async, gamma
// staged once) and reads each twice from there as norm_bwd_resident. Rows go R at a time (a
// step): one block reduction and one exchange for R rows' sums, since a row's exchange, not its
// bytes, bounds a step. A step's sums are collected LAG steps after they are published, so that
// the wait for the slowest tile overlaps LAG steps' work and NB / R - LAG steps stay in flight.
// ADD: the fused residual add's dres, staged with x and dy, added to dx. The flush is bwd_rows'
// (partials, atomics, or one row of blocks).
template <typename T, typename W, int NORM, int NPT, int WARP, int NB, int LAG, int R,
          bool ADD = false>
__global__ void __launch_bounds__(512) norm_bwd_grid(CLN_BWD_PARAMS) {
#if CLN_ASYNC_COPY
  constexpr int NS = NB / R;  // steps of rows held
  static_assert(R >= 1 && NB % R == 0 && LAG >= 0 && NS > LAG, "a step in flight at least");
  typedef float C;  // GridRowSums' tagged words hold float32 sums
  static_assert(sizeof(typename Acc<T>::type) == sizeof(C), "float32 accumulation");
  constexpr int VEC = 16 / (int)sizeof(T);
  typedef Pack<T, VEC> P;
  typedef typename Held<W, VEC>::type G;
  constexpr int ROWS_IN = ADD ? 3 : 2;  // the staged arrays of a row: x, dy (and dres)
  if (tickets == nullptr || blockDim.y != 1) cl_trap();
  const bool ln = is_ln<NORM>(mean);
  const GridRowSums<2 * R, WARP, 2 * LAG + 2> sums(tickets);
  extern __shared__ __align__(16) unsigned char cl_smem[];
  const int t = threadIdx.x, threads = blockDim.x;
  P* stage = reinterpret_cast<P*>(cl_smem);
  G* gstage = reinterpret_cast<G*>(stage + NB * ROWS_IN * NPT * threads);
  require_dynamic_smem(NB * ROWS_IN * NPT * threads * sizeof(P) +
                       NPT * threads * sizeof(G));
  const cl_i64 c0 = (cl_i64)blockIdx.y * threads * NPT * VEC;  // this block's column tile
  const C inv_n = cl_inv_count(C(0), N);
  C acc_g[NPT][VEC], acc_b[NPT][VEC];
#pragma unroll
  for (int k = 0; k < NPT; ++k)
#pragma unroll
    for (int j = 0; j < VEC; ++j) acc_g[k][j] = acc_b[k][j] = C(0);
  if (gamma) stage_packs<VEC, NPT, true>(gstage, gamma, c0, N, true);  // in step 0's group
  const cl_i64 first = blockIdx.x, step = gridDim.x;
  const cl_i64 n = first < M ? (M - 1 - first) / step + 1 : 0;  // this group's rows
  const cl_i64 steps = (n + R - 1) / R;
  auto prefetch = [&](cl_i64 i) {  // step i's rows q into buffers q % NB (zeros past n)
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const cl_i64 q = i * R + r;
      const bool ok = q < n;
      const cl_i64 row = ok ? first + q * step : 0;
      P* d = stage + (q % NB) * ROWS_IN * NPT * threads;
      stage_packs<VEC, NPT>(d, x + row * ldx, c0, N, ok);
      stage_packs<VEC, NPT>(d + NPT * threads, dy + row * lddy, c0, N, ok);
      if constexpr (ADD)
        stage_packs<VEC, NPT>(d + 2 * NPT * threads, dres + row * ldres, c0, N, ok);
    }
    async_commit();
  };
  auto rows_of = [&](cl_i64 q, SmemRow<P>& px, SmemRow<P>& pdy) {
    px = SmemRow<P>{stage + (q % NB) * ROWS_IN * NPT * threads + t, threads};
    pdy = SmemRow<P>{px.base + NPT * threads, threads};
  };
  for (int i = 0; i < NS - LAG; ++i) prefetch(i);
  int phase = 0;  // row_allreduce's calls: consecutive ones use its two buffers in turn
  for (cl_i64 i = 0; i < steps + LAG; ++i) {
    async_wait<NS - LAG - 1>();  // step i's copies have landed; the later ones stay in flight
    SmemRow<P> px, pdy;
    if (i < steps) {  // step i: its rows' sums published, dgamma/dbeta's terms added
      C s[2 * R];
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const cl_i64 q = i * R + r, row = first + q * step;
        C sr[2] = {C(0), C(0)};
        rows_of(q, px, pdy);
        if (q < n)
          smem_row_sums<NPT>(ln, px, pdy, gamma, gstage, ln ? (C)mean[row] : C(0),
                                 (C)rstd[row], c0, N, acc_g, acc_b, sr);
        s[2 * r] = sr[0];
        s[2 * r + 1] = sr[1];
      }
      row_allreduce<WARP>(s, phase++);
      sums.publish(s, i);
    }
    if (i >= LAG) {  // step i - LAG: every tile's sums, then dx
      C s[2 * R];
      sums.collect(s, i - LAG, phase++);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const cl_i64 q = (i - LAG) * R + r, row = first + q * step;
        const C sr[2] = {s[2 * r], s[2 * r + 1]};
        rows_of(q, px, pdy);
        const SmemRow<P> pdr{pdy.base + NPT * threads, threads};  // dres (ADD)
        if (dx && q < n)
          smem_row_dx<NPT, ADD>(ln, px, pdy, pdr, gamma, gstage, ln ? (C)mean[row] : C(0),
                                    (C)rstd[row], inv_n, sr, c0, N, dx + row * N);
      }
    }
    prefetch(i + NS - LAG);  // into step i - LAG's buffers, read above by this thread alone
  }
  async_wait<0>();  // the copies past the last row (zeros) land before the block exits
  sums.leave();
  ClusterSums<1, C> none;
  flush_params<W, VEC, NPT, 1, false>(acc_g, acc_b, none, c0, N, dgamma, dbeta, accum, counter,
                                      partial);
#else
  cl_trap();  // the planner launches it only where cp.async exists
#endif
}

// The two row sums of dx, sum(g) and sum(g * xhat), for rows longer than norm_bwd's registers
// hold: one row per block (blockDim.y == 1), the row read in chunks of blockDim.x * NPT * VEC;
// CL > 1 (sm_90): one row per cluster of CL blocks (gridDim.y == CL), block r reading chunks r,
// r + CL, ..., their sums added through the cluster, so that few rows still keep CL SMs each
// streaming. PARTS (few rows, any device): block (row, p) reads chunks p, p + gridDim.y, ... and
// writes its sums to rowsums[row][p] (gridDim.y parts per row), which norm_bwd_rowsums_merge adds.
// PEEL (one row per block, or in parts): rows peeled as norm_bwd_peeled's tiles take them, the
// middle in 16-byte vectors (VEC) from each row's head, the head and tail one element per thread
// of the first 2 * VEC (of part 0).
template <typename T, typename W, int VEC, int NPT, int WARP, int CL = 1,
          bool PARTS = false, bool PEEL = false>
__global__ void __launch_bounds__(1024) CLN_CLUSTER_DIMS(1, CL, 1)
norm_bwd_rowsums(const T* __restrict__ dy, cl_i64 lddy, const T* __restrict__ x, cl_i64 ldx,
                 const W* __restrict__ gamma, const float* __restrict__ mean,
                 const float* __restrict__ rstd, typename Acc<T>::type* __restrict__ rowsums,
                 cl_i64 M, cl_i64 N) {
  typedef typename Acc<T>::type C;
  static_assert(CL == 1 || !PARTS, "a row over a cluster or in parts");
  static_assert(!PEEL || (CL == 1 && VEC * sizeof(T) == 16), "peeled: no cluster");
  constexpr int SLOTS = cluster_slots<CL, WARP, 1024>();
  if constexpr (CL > 1) cluster_rows_init<CL, WARP, SLOTS, 2, C>();
  const cl_i64 chunk = (cl_i64)blockDim.x * NPT * VEC;
  const int split = CL > 1 ? CL : PARTS ? (int)gridDim.y : 1;  // blocks sharing a row
  const cl_i64 first = split > 1 ? blockIdx.y * chunk : 0;
  int phase = 0;
  for (cl_i64 row = blockIdx.x; row < M; row += gridDim.x, ++phase) {
    const T* xr = x + row * ldx;
    const T* dyr = dy + row * lddy;
    const C mu = mean ? (C)mean[row] : C(0);  // LayerNorm's (RMSNorm: none)
    const C rs = (C)rstd[row];
    C s[2] = {C(0), C(0)};
    // peeled: the middle's `end` elements from column `head` (else the whole row)
    const int head = PEEL ? peel_head(xr) : 0;
    const cl_i64 end = PEEL ? (N - head) / VEC * VEC : N;
    for (cl_i64 c0 = first; c0 < end; c0 += split * chunk) {
#pragma unroll
      for (int k = 0; k < NPT; ++k) {
        const cl_i64 col = c0 + ((cl_i64)k * blockDim.x + threadIdx.x) * VEC;
        if (col >= end) continue;
        C xv[VEC], dv[VEC], g[VEC];
        load_vec<VEC>(xr + head + col, xv);
        load_vec<VEC>(dyr + head + col, dv);
        if constexpr (PEEL) {
          peeled_params<VEC>(gamma, col, head, N, (size_t)gamma % (VEC * sizeof(W)) == 0, C(1),
                             g);
        } else if (gamma) {
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
    if constexpr (PEEL) {  // the head's and tail's elements
      const int t = threadIdx.x;
      const cl_i64 ec = t < VEC ? t : head + end + (t - VEC);
      if ((t < VEC ? t < head : t < 2 * VEC && ec < N) && (!PARTS || blockIdx.y == 0)) {
        const C gj = (gamma ? to_acc(gamma[ec]) : C(1)) * to_acc(dyr[ec]);
        s[0] += gj;
        s[1] += gj * ((to_acc(xr[ec]) - mu) * rs);
      }
    }
    if constexpr (CL > 1) cluster_allreduce<CL, SLOTS, WARP>(s, phase);
    else row_allreduce<WARP>(s, phase);
    const cl_i64 at = PARTS ? row * gridDim.y + blockIdx.y : row;
    if (threadIdx.x == 0 && (CL == 1 || blockIdx.y == 0)) {
      rowsums[2 * at] = s[0];
      rowsums[2 * at + 1] = s[1];
    }
  }
  if constexpr (CL > 1) cluster_sync();  // no block leaves while its sums are on their way
}

// The row sums of rows in parts: rowsums[row] = the sum of parts[row][0..G) in a fixed order
// (each lane its parts, then a butterfly), one warp per row (blockDim = (WARP, rows per block)).
template <typename C, int WARP>
__global__ void __launch_bounds__(1024)
norm_bwd_rowsums_merge(const C* __restrict__ parts, cl_i64 G, C* __restrict__ rowsums,
                       cl_i64 M) {
  const cl_i64 row = (cl_i64)blockIdx.x * blockDim.y + threadIdx.y;
  if (blockDim.x != WARP) cl_trap();
  if (row >= M) return;  // whole warps leave: the butterfly below stays within a warp
  C s[2] = {C(0), C(0)};
  for (cl_i64 i = threadIdx.x; i < G; i += WARP) {
    s[0] += parts[2 * (row * G + i)];
    s[1] += parts[2 * (row * G + i) + 1];
  }
  warp_allreduce<WARP>(s);
  if (threadIdx.x == 0) {
    rowsums[2 * row] = s[0];
    rowsums[2 * row + 1] = s[1];
  }
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

// The same sums for long rows (2N columns, few rows of partials; N a multiple of 4): four
// adjacent columns per thread, each with all eight of partial_groups' groups, added in the same
// order (the same bits), loaded 16 bytes at a time. norm_bwd_reduce's 32 columns per block gave
// a long row tens of thousands of blocks of mostly idle threads, bound by block launches.
template <typename C, typename W>
__global__ void __launch_bounds__(256)
norm_bwd_reduce_cols(const C* __restrict__ partial, cl_i64 P, cl_i64 N,
                     W* __restrict__ dgamma, W* __restrict__ dbeta) {
  const cl_i64 col = ((cl_i64)blockIdx.x * blockDim.x + threadIdx.x) * 4;  // in [0, 2N)
  const bool is_g = col < N;
  W* out = is_g ? dgamma : dbeta;
  if (col >= 2 * N || out == nullptr) return;
  C s[8][4];
#pragma unroll
  for (int g = 0; g < 8; ++g)
#pragma unroll
    for (int j = 0; j < 4; ++j) s[g][j] = C(0);
  for (cl_i64 p = 0; p < P; p += 8) {
#pragma unroll
    for (int g = 0; g < 8; ++g) {
      if (p + g >= P) break;
      const Pack<C, 4> v = *reinterpret_cast<const Pack<C, 4>*>(partial + (p + g) * 2 * N + col);
#pragma unroll
      for (int j = 0; j < 4; ++j) s[g][j] += v.v[j];
    }
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    C tot = C(0);
#pragma unroll
    for (int g = 0; g < 8; ++g) tot += s[g][j];
    out[(is_g ? col : col - N) + j] = Store<W>::cvt(tot);
  }
}
