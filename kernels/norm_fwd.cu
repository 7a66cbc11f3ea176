// Forward pass of LayerNorm (LN = true) and RMSNorm (LN = false), one template for both.
//
// Geometry (decided by cupyln/_launch.py alone): blockDim = (tpr, rows per block). A row is held
// in registers as chunks of tpr * NPT * VEC elements; thread t owns vectors k * tpr + t of a
// chunk. When the row is one chunk (the common case) x is read from memory once; longer rows
// are read twice (statistics, then output). Statistics are exact per chunk (sum, then centered
// sum of squares) and merged across chunks with Chan's formula: never E[x^2] - E[x]^2.
#include "common.cuh"

template <int VEC, int NPT, typename T, typename C>
__device__ __forceinline__ void load_chunk(const T* __restrict__ row, cl_i64 c0, cl_i64 N,
                                           bool valid, C (&v)[NPT][VEC]) {
#pragma unroll
  for (int k = 0; k < NPT; ++k) {
    const cl_i64 col = c0 + ((cl_i64)k * blockDim.x + threadIdx.x) * VEC;
    if (valid && col < N) {
      load_vec<VEC>(row + col, v[k]);
    } else {
#pragma unroll
      for (int j = 0; j < VEC; ++j) v[k][j] = C(0);
    }
  }
}

template <typename T, typename W, bool LN, int VEC, int NPT, int WARP>
__global__ void __launch_bounds__(1024)
norm_fwd(const T* __restrict__ x, cl_i64 ldx, const W* __restrict__ gamma,
         const W* __restrict__ beta, T* __restrict__ y, float* __restrict__ mean_out,
         float* __restrict__ rstd_out, cl_i64 M, cl_i64 N, typename Acc<T>::type eps) {
  typedef typename Acc<T>::type C;
  const int t = threadIdx.x;
  const cl_i64 chunk = (cl_i64)blockDim.x * NPT * VEC;
  const int nchunks = (int)((N + chunk - 1) / chunk);
  C v[NPT][VEC];
  // Every thread of the block runs the same number of iterations (the reductions need all).
  for (cl_i64 base = (cl_i64)blockIdx.x * blockDim.y; base < M;
       base += (cl_i64)gridDim.x * blockDim.y) {
    const cl_i64 row = base + threadIdx.y;
    const bool valid = row < M;
    const T* xr = x + (valid ? row : 0) * ldx;
    C run_n = C(0), run_mean = C(0), run_m2 = C(0);
    for (int c = 0; c < nchunks; ++c) {
      const cl_i64 c0 = (cl_i64)c * chunk;
      load_chunk<VEC, NPT>(xr, c0, N, valid, v);
      if (LN) {
        C s[1] = {C(0)};
#pragma unroll
        for (int k = 0; k < NPT; ++k)
#pragma unroll
          for (int j = 0; j < VEC; ++j) s[0] += v[k][j];
        row_allreduce<WARP>(s);
        const C cnt = (C)(N - c0 < chunk ? N - c0 : chunk);
        const C cmean = s[0] / cnt;
        C q[1] = {C(0)};
#pragma unroll
        for (int k = 0; k < NPT; ++k) {
          const bool inb = c0 + ((cl_i64)k * blockDim.x + t) * VEC < N;
#pragma unroll
          for (int j = 0; j < VEC; ++j) {
            const C d = inb ? v[k][j] - cmean : C(0);
            q[0] += d * d;
          }
        }
        row_allreduce<WARP>(q);
        const C tot = run_n + cnt;
        const C delta = cmean - run_mean;
        run_mean += delta * (cnt / tot);
        run_m2 += q[0] + delta * delta * (run_n * cnt / tot);
        run_n = tot;
      } else {
        C q[1] = {C(0)};
#pragma unroll
        for (int k = 0; k < NPT; ++k)
#pragma unroll
          for (int j = 0; j < VEC; ++j) q[0] += v[k][j] * v[k][j];
        row_allreduce<WARP>(q);
        run_m2 += q[0];
      }
    }
    const C mu = LN ? run_mean : C(0);
    const C rstd = cl_rsqrt(run_m2 / (C)N + eps);
    if (valid && t == 0) {
      if (LN) mean_out[row] = (float)mu;
      rstd_out[row] = (float)rstd;
    }
    T* yr = y + (valid ? row : 0) * N;
    for (int c = 0; c < nchunks; ++c) {
      const cl_i64 c0 = (cl_i64)c * chunk;
      if (nchunks > 1) load_chunk<VEC, NPT>(xr, c0, N, valid, v);
#pragma unroll
      for (int k = 0; k < NPT; ++k) {
        const cl_i64 col = c0 + ((cl_i64)k * blockDim.x + t) * VEC;
        if (!valid || col >= N) continue;
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
  }
}
