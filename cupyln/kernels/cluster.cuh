// Thread-block clusters (CUDA sm_90 on): rows longer than one block holds are split into CL
// column tiles, one per block of a cluster, and the blocks exchange their tiles' sums through
// distributed shared memory instead of a second pass reading the rows again. The forward and
// the backward's long rows use cluster_allreduce; the backward's column sums, bwd_common.cuh.
#pragma once
#include "common.cuh"

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
