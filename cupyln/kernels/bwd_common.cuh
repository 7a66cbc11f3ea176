// Backward-only device code: the row ticket counter, the column sums of one cluster, the column
// sums over a block's rows and the fixed-order sums of dgamma/dbeta partials.
#pragma once
#include "cluster.cuh"

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


// dx of one row from its two sums s = (sum(g), sum(g * xhat)), g = dy * gamma:
// dx = rs * (g - mean(g) - xhat * mean(g * xhat)) = g * rs - (xhat * a + b), two fused
// multiply-adds per element (RMSNorm, !ln: no mean(g) term, b = 0).
template <typename C> struct DxRow {
  C rs, a, b;
  __device__ __forceinline__ DxRow(bool ln, C rstd, const C (&s)[2], C inv_n)
      : rs(rstd), a(rstd * (s[1] * inv_n)), b(ln ? rstd * (s[0] * inv_n) : C(0)) {}
  __device__ __forceinline__ C operator()(C g, C xh) const { return g * rs - (xh * a + b); }
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

// Row sums of rows split over the gridDim.y column tiles of a cooperative grid (every block
// resident at once; the host launches it so), through global memory: each block publishes its
// tile's K float32 sums of a row (or of a step of rows), each in one 64-bit word with the tag
// i + 1 (numbered per group, group = blockIdx.x, whose blocks take the same rows in the same
// order), so a reader that sees the tag sees the value: no fence, no counter. Collecting them
// waits for every tile's tags, then adds the tiles in one fixed order (every block gets the
// same bits). `area` is zeroed memory, left zeroed by the last block to leave (stale tags would
// match a later launch's): a count of blocks done (16 bytes), then the slots [gridDim.x][SL]
// [gridDim.y][K]. A block that collects row i at most LAG rows after publishing it writes row
// i + SL only after every tile has collected row i where SL >= 2 * LAG + 2.
template <int K, int WARP, int SL> struct GridRowSums {
  unsigned int* done;
  unsigned long long* slots;
  __device__ __forceinline__ explicit GridRowSums(unsigned int* area)
      : done(area), slots(reinterpret_cast<unsigned long long*>(area + 4)) {}

  __device__ __forceinline__ volatile unsigned long long* row(cl_i64 i) const {
    return slots + ((cl_i64)blockIdx.x * SL + i % SL) * gridDim.y * K;
  }

  // Thread 0 of the block, with the block's sums of row i in v.
  __device__ __forceinline__ void publish(const float (&v)[K], cl_i64 i) const {
    if (threadIdx.x != 0) return;
    const unsigned long long tag = (unsigned long long)(i + 1) << 32;
#pragma unroll
    for (int k = 0; k < K; ++k) row(i)[blockIdx.y * K + k] = tag | __float_as_uint(v[k]);
  }

  // Every thread of the block: row i's sums over all tiles into v (phase: row_allreduce's).
  __device__ __forceinline__ void collect(float (&v)[K], cl_i64 i, int phase) const {
    const unsigned int tag = (unsigned int)(i + 1);
#pragma unroll
    for (int k = 0; k < K; ++k) v[k] = 0.f;
    for (unsigned int b = threadIdx.x; b < gridDim.y; b += blockDim.x) {
      volatile unsigned long long* p = row(i) + b * K;
      unsigned long long w[K];
#pragma unroll
      for (int k = 0; k < K; ++k) w[k] = p[k];
#pragma unroll
      for (int k = 0; k < K; ++k) {
        while ((unsigned int)(w[k] >> 32) != tag) w[k] = p[k];
        v[k] += __uint_as_float((unsigned int)w[k]);
      }
    }
    row_allreduce<WARP>(v, phase);
  }

  // Every thread, after its block's last row: the last block to leave zeroes the area again.
  __device__ __forceinline__ void leave() const {
    __shared__ bool is_last;
    const unsigned int blocks = gridDim.x * gridDim.y;
    __syncthreads();
    if (threadIdx.x == 0) is_last = atomicAdd(done, 1u) == blocks - 1;
    __syncthreads();
    if (!is_last) return;
    const cl_i64 n = (cl_i64)gridDim.x * SL * gridDim.y * K;
    for (cl_i64 i = threadIdx.x; i < n; i += blockDim.x) slots[i] = 0;
    if (threadIdx.x == 0) *done = 0;
  }
};

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
