// Backward-only device code: the row ticket counter, the cluster exchanges (row sums of
// column tiles, column sums of one cluster), the column sums over a block's rows and the
// fixed-order sums of dgamma/dbeta partials.
#pragma once
#include "common.cuh"

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

// Sums over the CL blocks of a thread-block cluster (CUDA sm_90 on): rows longer than one block
// holds are split into CL column tiles, one per block of a cluster, and the blocks exchange
// their tiles' sums through distributed shared memory instead of a second kernel reading the
// rows again (cluster_allreduce below).
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

// Sums over the row's threads in the CL blocks of a cluster (blockDim = (whole warps, 1), at
// most S / CL warps) of this row's K = 2 values; `phase` is the row counter.
template <int CL, int S, int WARP, int K, typename C>
__device__ __forceinline__ void cluster_allreduce(C (&v)[K], int phase) {
  static_assert(K == 2, "two row sums");
#if CLN_CLUSTERS
  warp_allreduce<WARP>(v);
  auto& x = cluster_exchange<S, K, C>();
  const int b = phase & 1;
  const int lane = threadIdx.x % WARP, nw = blockDim.x / WARP, slots = CL * nw;
  const unsigned int bar = smem_addr(&x.bar[b]);
  if (threadIdx.x == 0) mbarrier_expect(bar, (unsigned int)(slots * K * sizeof(C)));
  if (lane < CL) {
    const unsigned int slot = smem_addr(&x.recv[b][cluster_rank() * nw + threadIdx.x / WARP][0]);
    st_async2(cluster_addr(slot, lane), v[0], v[1], cluster_addr(bar, lane));
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
