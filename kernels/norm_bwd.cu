// Backward pass of LayerNorm (LN = true) and RMSNorm (LN = false), one template family.
//
//   xhat = (x - mean) * rstd  (RMSNorm: x * rstd),  g = dy * gamma
//   dx = rstd * (g - mean(g) - xhat * mean(g * xhat))   (RMSNorm: no mean(g) term)
//   dgamma = sum_rows(dy * xhat),  dbeta = sum_rows(dy)
//
// norm_bwd reads x and dy once: it computes dx row by row and, in the same pass, accumulates the
// dgamma/dbeta partial sums of its rows in registers. At the end each block either adds its
// partials into a float32 N-vector with atomicAdd (the last block to finish casts that vector
// into dgamma/dbeta), or writes them to its own row of a [blocks, 2N] scratch that
// norm_bwd_reduce sums in a fixed order (deterministic). Rows too long for registers take two
// kernels: norm_bwd_rowsums computes each row's two sums, then norm_bwd runs on column tiles
// (gridDim.y > 1) with those sums given.
#include "common.cuh"

// The raw loads of one row: its vectors of x and dy from the block's first column (packed as
// stored; zero past `rem` columns and for rows past M) and its statistics.
template <bool LN, int VEC, int NPT, typename T>
__device__ __forceinline__ void load_bwd_row(const T* __restrict__ dy, cl_i64 lddy,
                                             const T* __restrict__ x, cl_i64 ldx,
                                             const float* __restrict__ mean,
                                             const float* __restrict__ rstd, cl_i64 row,
                                             cl_i64 M, int rem, Pack<T, VEC> (&px)[NPT],
                                             Pack<T, VEC> (&pdy)[NPT], float& mu, float& rs) {
  const bool valid = row < M;
  const cl_i64 r = valid ? row : 0;
  load_packs<VEC, NPT>(x + r * ldx, 0, rem, valid, px);
  load_packs<VEC, NPT>(dy + r * lddy, 0, rem, valid, pdy);
  mu = (LN && valid) ? mean[r] : 0.f;
  rs = valid ? rstd[r] : 0.f;
}

// One vector per thread fits 1024-thread blocks in 64 registers; two need up to 128. With one
// vector per thread the next row's loads are issued before this row is reduced (PREFETCH), so
// two rows per thread are in flight; rows are held as loaded (bfloat16 packed, see RowVec) and
// xhat and dy * gamma are recomputed for dx rather than kept.
template <typename T, typename W, bool LN, int VEC, int NPT, int WARP>
__global__ void __launch_bounds__(NPT == 1 ? 1024 : 512)
norm_bwd(const T* __restrict__ dy, cl_i64 lddy, const T* __restrict__ x, cl_i64 ldx,
         const W* __restrict__ gamma, const float* __restrict__ mean,
         const float* __restrict__ rstd, const typename Acc<T>::type* __restrict__ rowsums,
         T* __restrict__ dx, W* __restrict__ dgamma, W* __restrict__ dbeta,
         typename Acc<T>::type* __restrict__ accum, unsigned int* __restrict__ counter,
         typename Acc<T>::type* __restrict__ partial, cl_i64 M, cl_i64 N) {
  typedef typename Acc<T>::type C;
  typedef typename RowVec<T, VEC>::type R;
  constexpr bool PREFETCH = NPT == 1;
  extern __shared__ unsigned char cl_smem[];
  const int t = threadIdx.x;
  const C inv_n = C(1) / (C)N;
  const cl_i64 c0 = (cl_i64)blockIdx.y * blockDim.x * NPT * VEC;  // this block's column tile
  const cl_i64 tile = (cl_i64)blockDim.x * NPT * VEC;
  const int rem = (int)(N - c0 < tile ? N - c0 : tile);  // columns of this tile
  const T* __restrict__ xc = x + c0;  // column offsets below are relative to the tile
  const T* __restrict__ dyc = dy + c0;
  const W* __restrict__ gc = gamma ? gamma + c0 : gamma;
  const bool want_g = dgamma != nullptr, want_b = dbeta != nullptr;
  C acc_g[NPT][VEC], acc_b[NPT][VEC];
#pragma unroll
  for (int k = 0; k < NPT; ++k)
#pragma unroll
    for (int j = 0; j < VEC; ++j) acc_g[k][j] = acc_b[k][j] = C(0);

  const cl_i64 step = (cl_i64)gridDim.x * blockDim.y;
  Pack<T, VEC> px[NPT], pdy[NPT];
  float fmu, frs;
  if (PREFETCH)
    load_bwd_row<LN, VEC, NPT>(dyc, lddy, xc, ldx, mean, rstd,
                               (cl_i64)blockIdx.x * blockDim.y + threadIdx.y, M, rem, px, pdy,
                               fmu, frs);
  int phase = 0;
  for (cl_i64 base = (cl_i64)blockIdx.x * blockDim.y; base < M; base += step, ++phase) {
    const cl_i64 row = base + threadIdx.y;
    const bool valid = row < M;
    if (!PREFETCH)
      load_bwd_row<LN, VEC, NPT>(dyc, lddy, xc, ldx, mean, rstd, row, M, rem, px, pdy, fmu, frs);
    R xr[NPT], dr[NPT];
#pragma unroll
    for (int k = 0; k < NPT; ++k) {
      to_row(px[k], xr[k]);
      to_row(pdy[k], dr[k]);
    }
    const C mu = (C)fmu, rs = (C)frs;
    if (PREFETCH)  // the next row's loads fly while this one is reduced
      load_bwd_row<LN, VEC, NPT>(dyc, lddy, xc, ldx, mean, rstd, row + step, M, rem, px, pdy,
                                 fmu, frs);
    C s[2] = {C(0), C(0)};
#pragma unroll
    for (int k = 0; k < NPT; ++k) {
      const int col = (k * (int)blockDim.x + t) * VEC;
      const bool inb = valid && col < rem;
      Pack<W, VEC> gp;
      if (gamma && inb) gp = *reinterpret_cast<const Pack<W, VEC>*>(gc + col);
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        // out of bounds: dy = 0 so nothing accumulates; xhat forced to 0 (mu may be inf/nan)
        const C xh = inb ? ((C)elem(xr[k], j) - mu) * rs : C(0);
        const C d = (C)elem(dr[k], j);
        const C g = (gamma && inb) ? (C)elem(gp, j) * d : d;
        s[0] += g;
        s[1] += g * xh;
        acc_g[k][j] += d * xh;
        acc_b[k][j] += d;
      }
    }
    if (rowsums) {  // long rows: the sums come from norm_bwd_rowsums
      s[0] = valid ? rowsums[2 * row] : C(0);
      s[1] = valid ? rowsums[2 * row + 1] : C(0);
    } else {
      row_allreduce<WARP>(s, phase);
    }
    if (dx && valid) {
      // recompute xhat and dy * gamma from the row as held (see opaque)
      C mu2 = mu, rs2 = rs;
      opaque(mu2);
      opaque(rs2);
#pragma unroll
      for (int k = 0; k < NPT; ++k) {
        opaque(xr[k]);
        opaque(dr[k]);
      }
      const C mg = LN ? s[0] * inv_n : C(0);
      const C mgx = s[1] * inv_n;
      T* dxr = dx + row * N + c0;
#pragma unroll
      for (int k = 0; k < NPT; ++k) {
        const int col = (k * (int)blockDim.x + t) * VEC;
        if (col >= rem) continue;
        Pack<W, VEC> gp;  // read again (L1) rather than held across the reduction
        if (gamma) gp = *reinterpret_cast<const Pack<W, VEC>*>(gc + col);
        C o[VEC];
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          const C xh = ((C)elem(xr[k], j) - mu2) * rs2;
          const C d = (C)elem(dr[k], j);
          const C g = gamma ? (C)elem(gp, j) * d : d;
          o[j] = rs2 * (g - mg - xh * mgx);
        }
        store_vec<VEC>(dxr + col, o);
      }
    }
  }

  if (!want_g && !want_b) return;  // uniform: no barrier below is skipped by part of a block
  C* buf = reinterpret_cast<C*>(cl_smem);
#pragma unroll
  for (int k = 0; k < NPT; ++k) {
    if (want_g) sum_over_block_rows<VEC>(acc_g[k], buf);
    if (want_b) sum_over_block_rows<VEC>(acc_b[k], buf);
  }
  if (threadIdx.y == 0) {
#pragma unroll
    for (int k = 0; k < NPT; ++k) {
      const cl_i64 col = c0 + ((cl_i64)k * blockDim.x + t) * VEC;
      if (col >= N) continue;
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        if (partial) {
          C* p = partial + (cl_i64)blockIdx.x * 2 * N;
          if (want_g) p[col + j] = acc_g[k][j];
          if (want_b) p[N + col + j] = acc_b[k][j];
        } else {
          if (want_g) atomicAdd(accum + col + j, acc_g[k][j]);
          if (want_b) atomicAdd(accum + N + col + j, acc_b[k][j]);
        }
      }
    }
  }
  if (partial) return;

  // Atomic mode: the last block to finish casts the accumulated vector into dgamma/dbeta.
  __shared__ bool is_last;
  __threadfence();
  __syncthreads();
  const int tid = threadIdx.y * blockDim.x + t;
  if (tid == 0) is_last = atomicAdd(counter, 1u) == gridDim.x * gridDim.y - 1;
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  const volatile C* acc = accum;
  for (cl_i64 col = tid; col < N; col += (cl_i64)blockDim.x * blockDim.y) {
    if (want_g) dgamma[col] = Store<W>::cvt(acc[col]);
    if (want_b) dbeta[col] = Store<W>::cvt(acc[N + col]);
  }
}

// The two row sums of dx, sum(g) and sum(g * xhat), for rows longer than norm_bwd's registers
// hold: one row per block (blockDim.y == 1), the row read in chunks of blockDim.x * NPT * VEC.
template <typename T, typename W, bool LN, int VEC, int NPT, int WARP>
__global__ void __launch_bounds__(1024)
norm_bwd_rowsums(const T* __restrict__ dy, cl_i64 lddy, const T* __restrict__ x, cl_i64 ldx,
                 const W* __restrict__ gamma, const float* __restrict__ mean,
                 const float* __restrict__ rstd, typename Acc<T>::type* __restrict__ rowsums,
                 cl_i64 M, cl_i64 N) {
  typedef typename Acc<T>::type C;
  int phase = 0;
  for (cl_i64 row = blockIdx.x; row < M; row += gridDim.x, ++phase) {
    const T* xr = x + row * ldx;
    const T* dyr = dy + row * lddy;
    const C mu = LN ? (C)mean[row] : C(0);
    const C rs = (C)rstd[row];
    C s[2] = {C(0), C(0)};
    for (cl_i64 c0 = 0; c0 < N; c0 += (cl_i64)blockDim.x * NPT * VEC) {
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
    row_allreduce<WARP>(s, phase);
    if (threadIdx.x == 0) {
      rowsums[2 * row] = s[0];
      rowsums[2 * row + 1] = s[1];
    }
  }
}

// Deterministic dgamma/dbeta: sum the [P, 2N] partials over P in a fixed order and cast.
// blockDim = (32, 8): 32 columns per block, 8 strided partial rows per column, then a fixed
// sequential sum of the 8.
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
    for (cl_i64 p = threadIdx.y; p < P; p += 8) s += partial[p * 2 * N + col];
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
