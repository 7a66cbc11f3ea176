// Forward pass of LayerNorm (LN = true) and RMSNorm (LN = false), one template for both.
//
// Geometry (decided by cupyln/_launch.py alone): blockDim = (tpr, rows per block). A row is held
// in registers as chunks of tpr * NPT * VEC elements; thread t owns vectors k * tpr + t of a
// chunk. When the row is one chunk (the common case) x is read from memory once; longer rows
// are read twice (statistics, then output). LayerNorm statistics: each thread's exact (count, mean, M2), merged across
// threads and chunks with Chan's formula in one reduction: never E[x^2] - E[x]^2.
#include "common.cuh"

// This thread's part of the row statistics over one chunk held in v, merged into (n, mean, m2).
template <bool LN, int VEC, int NPT, typename C>
__device__ __forceinline__ void chunk_stats(const C (&v)[NPT][VEC], cl_i64 c0, cl_i64 N,
                                            C& n, C& mean, C& m2) {
  C cnt = C(0), s = C(0);
#pragma unroll
  for (int k = 0; k < NPT; ++k) {
    const bool inb = c0 + ((cl_i64)k * blockDim.x + threadIdx.x) * VEC < N;
#pragma unroll
    for (int j = 0; j < VEC; ++j) s += LN ? v[k][j] : v[k][j] * v[k][j];
    cnt += inb ? C(VEC) : C(0);
  }
  if (!LN) {  // RMSNorm: only the sum of squares (in m2)
    m2 += s;
    return;
  }
  const C cm = cnt > C(0) ? s / cnt : C(0);
  C q = C(0);
#pragma unroll
  for (int k = 0; k < NPT; ++k) {
    const bool inb = c0 + ((cl_i64)k * blockDim.x + threadIdx.x) * VEC < N;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const C d = inb ? v[k][j] - cm : C(0);
      q += d * d;
    }
  }
  chan_merge(n, mean, m2, cnt, cm, q);
}

// Reduce the row's statistics over its threads; returns (mean, rstd). RMSNorm: mean = 0.
template <bool LN, int WARP, typename C>
__device__ __forceinline__ void finish_stats(C n, C mean, C m2, cl_i64 N, C eps, C& mu,
                                             C& rstd) {
  if (LN) {
    row_allreduce_stats<WARP>(n, mean, m2);
    mu = mean;
  } else {
    C q[1] = {m2};
    row_allreduce<WARP>(q);
    m2 = q[0];
    mu = C(0);
  }
  rstd = cl_rsqrt(m2 / (C)N + eps);
}

template <int VEC, int NPT, typename T, typename W, typename C>
__device__ __forceinline__ void write_chunk(const C (&v)[NPT][VEC], cl_i64 c0, cl_i64 N, C mu,
                                            C rstd, const W* __restrict__ gamma,
                                            const W* __restrict__ beta, T* __restrict__ yr) {
#pragma unroll
  for (int k = 0; k < NPT; ++k) {
    const cl_i64 col = c0 + ((cl_i64)k * blockDim.x + threadIdx.x) * VEC;
    if (col >= N) continue;
    C g[VEC], b[VEC], o[VEC];
    if (gamma) {
      load_vec<VEC>(gamma + col, g);
    } else {
#pragma unroll
      for (int j = 0; j < VEC; ++j) g[j] = C(1);
    }
    if (beta) {
      load_vec<VEC>(beta + col, b);
    } else {
#pragma unroll
      for (int j = 0; j < VEC; ++j) b[j] = C(0);
    }
#pragma unroll
    for (int j = 0; j < VEC; ++j) o[j] = (v[k][j] - mu) * rstd * g[j] + b[j];
    store_vec<VEC>(yr + col, o);
  }
}

template <typename T, typename W, bool LN, int VEC, int NPT, int WARP>
__global__ void __launch_bounds__(1024)
norm_fwd(const T* __restrict__ x, cl_i64 ldx, const W* __restrict__ gamma,
         const W* __restrict__ beta, T* __restrict__ y, float* __restrict__ mean_out,
         float* __restrict__ rstd_out, cl_i64 M, cl_i64 N, typename Acc<T>::type eps) {
  typedef typename Acc<T>::type C;
  const cl_i64 chunk = (cl_i64)blockDim.x * NPT * VEC;
  const int nchunks = (int)((N + chunk - 1) / chunk);
  const cl_i64 step = (cl_i64)gridDim.x * blockDim.y;
  C v[NPT][VEC];
  // Every thread of the block runs the same number of iterations (the reductions need all).
  for (cl_i64 base = (cl_i64)blockIdx.x * blockDim.y; base < M; base += step) {
    const cl_i64 row = base + threadIdx.y;
    const bool valid = row < M;
    const T* xr = x + (valid ? row : 0) * ldx;
    C n = C(0), mean = C(0), m2 = C(0), mu, rstd;
    for (int c = 0; c < nchunks; ++c) {
      Pack<T, VEC> p[NPT];
      load_packs<VEC, NPT>(xr, (cl_i64)c * chunk, N, valid, p);
      unpack(p, v);
      chunk_stats<LN>(v, (cl_i64)c * chunk, N, n, mean, m2);
    }
    finish_stats<LN, WARP>(n, mean, m2, N, eps, mu, rstd);
    if (valid && threadIdx.x == 0) {
      if (LN) mean_out[row] = (float)mu;
      rstd_out[row] = (float)rstd;
    }
    for (int c = 0; c < nchunks && valid; ++c) {
      if (nchunks > 1) {  // the row did not stay in registers: read this chunk again
        Pack<T, VEC> p[NPT];
        load_packs<VEC, NPT>(xr, (cl_i64)c * chunk, N, valid, p);
        unpack(p, v);
      }
      write_chunk(v, (cl_i64)c * chunk, N, mu, rstd, gamma, beta, y + row * N);
    }
  }
}
