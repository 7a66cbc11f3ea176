// cupyln common device code: storage types and conversions, vector I/O, reductions.
// Compiles with NVRTC (CUDA) and hipcc/hiprtc (HIP) alike: no headers, no hard-coded warp size
// (every reduction takes WARP, 32 or 64, as a template argument), maskless shuffles on HIP.
#pragma once

#if defined(__HIPCC__) || defined(__HIP__) || defined(__HIPCC_RTC__)
#define CLN_HIP 1
#endif

typedef long long cl_i64;

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
// row's reductions without registers to hold them (a register prefetch, v7, had cost more
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

template <int V, typename T, typename C>
__device__ __forceinline__ void store_vec(T* __restrict__ p, const C (&in)[V]) {
  Pack<T, V> pk;
  if constexpr (sizeof(T) == 2 && V % 2 == 0) {  // 16-bit pairs: half the conversions
    unsigned int* w = reinterpret_cast<unsigned int*>(pk.v);
#pragma unroll
    for (int j = 0; j < V; j += 2) w[j / 2] = pack2<T>((float)in[j], (float)in[j + 1]);
  } else {
#pragma unroll
    for (int j = 0; j < V; ++j) pk.v[j] = Store<T>::cvt(in[j]);
  }
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
// TPR (> 0): the row's threads fixed at compile time, so the branches and the butterfly's trip
// count below are constants (see FWD_FIXED_WARPS in _launch.py).
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

// Rows of a grid of resident blocks taken dynamically (the staged backward where it need not be
// deterministic): block b of nb takes groups (of rows; `groups` in all, < 2^31) b, b + nb,
// b + 2nb and b + 3nb in its iterations 0-3, then group 4nb + t for each ticket t that its
// thread 0 takes from `tickets` (zeroed). A fast block takes more groups than a slow one; a
// static assignment cannot follow SMs of different speeds (resident forward grids, S15-2: 5-12%
// slower than one-row blocks with static rows, 1-2% with tickets). In each iteration thread 0
// takes (take) the group of the iteration after the next two, from the ticket it took an
// iteration earlier, so the ticket's round trip never holds up a row (taken in the same
// iteration, a backward ran 13% slower than static rows, S15-3); the kernel hands it on to its
// threads through shared memory before the row's reduction barrier, and every thread moves on
// (advance) after that barrier. The next two groups stay in registers: kept in shared memory
// instead (a ring of 4 slots), the backward ran 18-32% slower (S16-2). Thread 0 stops after its
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
// waits for the thread's outstanding memory operations, the next row's copies included: tune.py
// S9-5, 4096x16384 f16 152.9 us with it against 131.7 with the barrier relaxed (which orders
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
// compiler may route through the read-only path: tune.py S9-1, 192x1024 bf16 backward 9.5 /
// 10.6 us plain against 10.2 / 11.4 with load_l2 (two interleaved pairs).
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
