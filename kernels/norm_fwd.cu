// Forward pass of LayerNorm (LN = true) and RMSNorm (LN = false), one template for both.
//
// Geometry (decided by cupyln/_launch.py alone): blockDim = (tpr, rows per block). A row is held
// in registers as chunks of tpr * NPT * VEC elements; thread t owns vectors k * tpr + t of a
// chunk. When the row is one chunk (the common case) x is read from memory once; longer rows
// are read twice (statistics, then output). Statistics are exact per chunk (sum, then centered
// sum of squares) and merged across chunks with Chan's formula: never E[x^2] - E[x]^2.
#include "common.cuh"


// Merge one chunk held in v into the row statistics (n, mean, m2), identical on every thread
// of the row: exact two-pass on the chunk (sum, then centered sum of squares), then Chan's
// formula across chunks. RMSNorm keeps only the sum of squares (in m2).
template <bool LN, int WARP, int VEC, int NPT, typename C>
__device__ __forceinline__ void chunk_stats(const C (&v)[NPT][VEC], cl_i64 c0, cl_i64 N,
                                            cl_i64 chunk, C& n, C& mean, C& m2) {
  C s[1] = {C(0)};
#pragma unroll
  for (int k = 0; k < NPT; ++k)
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      s[0] += LN ? v[k][j] : v[k][j] * v[k][j];
    }
  row_allreduce<WARP>(s);
  if (!LN) {
    m2 += s[0];
    return;
  }
  const C cnt = (C)(N - c0 < chunk ? N - c0 : chunk);
  const C cm = s[0] / cnt;
  C q[1] = {C(0)};
#pragma unroll
  for (int k = 0; k < NPT; ++k) {
    const bool inb = c0 + ((cl_i64)k * blockDim.x + threadIdx.x) * VEC < N;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const C d = inb ? v[k][j] - cm : C(0);
      q[0] += d * d;
    }
  }
  row_allreduce<WARP>(q);
  chan_merge(n, mean, m2, cnt, cm, q[0]);
}

template <int VEC, int NPT, typename T, typename C>
__device__ __forceinline__ void load_chunk(const T* __restrict__ row, cl_i64 c0, cl_i64 N,
                                           bool valid, C (&v)[NPT][VEC]) {
  Pack<T, VEC> p[NPT];
  load_packs<VEC, NPT>(row, c0, N, valid, p);
  unpack(p, v);
}

template <int VEC, int NPT, typename T, typename W, typename C>
__device__ __forceinline__ void write_chunk(const C (&v)[NPT][VEC], int c0, int N, C mu, C rstd,
                                            const W* __restrict__ gamma,
                                            const W* __restrict__ beta, T* __restrict__ yr) {
#pragma unroll
  for (int k = 0; k < NPT; ++k) {
    const int col = c0 + (k * (int)blockDim.x + (int)threadIdx.x) * VEC;
    if (col >= N) continue;
    // parameters stay packed until used: fewer live registers than float copies
    Pack<W, VEC> g, b;
    if (gamma) g = *reinterpret_cast<const Pack<W, VEC>*>(gamma + col);
    if (beta) b = *reinterpret_cast<const Pack<W, VEC>*>(beta + col);
    Pack<T, VEC> o;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      C val = (v[k][j] - mu) * rstd;
      if (gamma) val *= (C)to_acc(g.v[j]);
      if (beta) val += (C)to_acc(b.v[j]);
      o.v[j] = Store<T>::cvt(val);
    }
    *reinterpret_cast<Pack<T, VEC>*>(yr + col) = o;
  }
}

// Rows of one chunk (CHUNKED = false: the row stays in registers, x is read once) or of many
// (CHUNKED = true: statistics over all chunks, then each chunk read again for the output).
template <bool CHUNKED, typename T, typename W, bool LN, int VEC, int NPT, int WARP>
__device__ __forceinline__ void fwd_rows(const T* __restrict__ x, cl_i64 ldx,
                                         const W* __restrict__ gamma, const W* __restrict__ beta,
                                         T* __restrict__ y, float* __restrict__ mean_out,
                                         float* __restrict__ rstd_out, cl_i64 M, cl_i64 N,
                                         typename Acc<T>::type eps) {
  typedef typename Acc<T>::type C;
  const cl_i64 chunk = (cl_i64)blockDim.x * NPT * VEC;
  const int nchunks = CHUNKED ? (int)((N + chunk - 1) / chunk) : 1;
  const cl_i64 step = (cl_i64)gridDim.x * blockDim.y;
  C v[NPT][VEC];
  // Every thread of the block runs the same number of iterations (the reductions need all).
  for (cl_i64 base = (cl_i64)blockIdx.x * blockDim.y; base < M; base += step) {
    const cl_i64 row = base + threadIdx.y;
    const bool valid = row < M;
    const T* xr = x + (valid ? row : 0) * ldx;
    C n = C(0), mean = C(0), m2 = C(0);
    for (int c = 0; c < nchunks; ++c) {
      load_chunk<VEC, NPT>(xr, (cl_i64)c * chunk, N, valid, v);
      chunk_stats<LN, WARP, VEC, NPT>(v, (cl_i64)c * chunk, N, chunk, n, mean, m2);
    }
    const C mu = LN ? mean : C(0);
    const C rstd = cl_rsqrt(m2 / (C)N + eps);
    if (valid && threadIdx.x == 0) {
      if (LN) mean_out[row] = (float)mu;
      rstd_out[row] = (float)rstd;
    }
    for (int c = 0; c < nchunks && valid; ++c) {
      if (CHUNKED) load_chunk<VEC, NPT>(xr, (cl_i64)c * chunk, N, valid, v);  // read again
      write_chunk<VEC, NPT>(v, c * (int)chunk, (int)N, mu, rstd, gamma, beta, y + row * N);
    }
  }
}

#define CLN_FWD_PARAMS                                                                        \
  const T *__restrict__ x, cl_i64 ldx, const W *__restrict__ gamma, const W *__restrict__ beta, \
      T *__restrict__ y, float *__restrict__ mean_out, float *__restrict__ rstd_out, cl_i64 M, \
      cl_i64 N, typename Acc<T>::type eps

template <typename T, typename W, bool LN, int VEC, int NPT, int WARP>
__global__ void __launch_bounds__(1024) norm_fwd(CLN_FWD_PARAMS) {
  fwd_rows<false, T, W, LN, VEC, NPT, WARP>(x, ldx, gamma, beta, y, mean_out, rstd_out, M, N,
                                            eps);
}

// Rows longer than one chunk: 4 vectors per thread (the planner's choice for long rows).
template <typename T, typename W, bool LN, int VEC, int WARP>
__global__ void __launch_bounds__(1024) norm_fwd_chunked(CLN_FWD_PARAMS) {
  fwd_rows<true, T, W, LN, VEC, 4, WARP>(x, ldx, gamma, beta, y, mean_out, rstd_out, M, N, eps);
}
