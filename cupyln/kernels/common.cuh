// cupyln common device code: storage types and conversions, vector I/O, reductions.
// Compiles with NVRTC (CUDA) and hipcc/hiprtc (HIP) alike: no headers, no hard-coded warp size
// (every reduction takes WARP, 32 or 64, as a template argument), maskless shuffles on HIP.
#pragma once
#include "float8.cuh"

#if defined(__HIPCC__) || defined(__HIP__) || defined(__HIPCC_RTC__)
#define CLN_HIP 1
#endif

typedef long long cl_i64;

// Named template arguments: the host's name expressions (cupyln/_compile.py, Spec.names) spell
// a kernel's variant with these, so that a name says what the kernel is.
namespace cln {
constexpr int rmsnorm = 0, layernorm = 1, either_norm = 2;  // a kernel's norm (see is_ln)
constexpr bool staged = true, direct = false;           // rows copied ahead into shared memory
constexpr bool params_early = true, params_late = false;  // gamma/beta loaded with the row
constexpr bool cols_full = true, cols_tested = false;   // every vector lies in the row
constexpr bool last_block_sums = true, partials = false;  // who sums dgamma/dbeta partials
constexpr bool tickets = true;                           // rows handed out by a counter
constexpr bool chunks = true, one_chunk = false;        // a row read in chunks (twice)
constexpr bool part_apply = true, part_stats = false;   // the two launches of rows in parts
constexpr bool in_parts = true, whole_rows = false;     // a backward row's sums in parts
constexpr bool peeled = true;                           // rows' heads and tails peeled off
constexpr bool col_tiles = true, row_blocks = false;    // long rows on column tiles
constexpr bool dresidual = true;                        // the fused add's gradient added to dx
constexpr bool residual_add = true, no_add = false;     // the float8 forward's fused add
constexpr int row_scales = 1, tensor_scale = 2;  // the float8 forward's scaling (0: none)
constexpr int dresidual_staged = 2;  // the same, staged in shared memory (norm_bwd_resident)
}  // namespace cln

// Stops the kernel with an error: for host/kernel mismatches that would give wrong results.
__device__ __forceinline__ void cl_trap() {
#ifdef CLN_HIP
  __builtin_trap();
#else
  __trap();
#endif
}

// Whether a kernel computes LayerNorm (else RMSNorm). Most kernels hold both (NORM =
// cln::either_norm): the host gives LayerNorm's mean (its output in the forward, the saved one in
// the backward) and no mean for RMSNorm, and the choice, uniform over the launch, is a branch.
// The kernels where that branch cost time (registers spilled, a compute-bound chain grew) fix the
// norm at compile time, and the host launches them with the mean exactly for LayerNorm. (A trap
// on a mismatch made ptxas spill in the float8 kernel.)
template <int NORM> __device__ __forceinline__ bool is_ln(const void* mean) {
  return NORM == cln::either_norm ? mean != nullptr : NORM == cln::layernorm;
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

// A peeled row's head: its elements before the row's first 16-byte boundary.
template <typename T> __device__ __forceinline__ int peel_head(const T* row) {
  return (int)(((16 - ((size_t)row & 15)) & 15) / sizeof(T));
}

// VEC parameters (gamma or beta) of a peeled row's pack at column head + a (a a multiple of
// VEC, head < VEC, head + a + VEC <= N), converted to C; `fill` where p is NULL. Where p is
// aligned to packs (`aligned`, the caller's test) and a + 2 * VEC <= N: the two aligned packs at
// a and a + VEC shifted down by head elements (whole words, then half a word); else one load
// per element. For the backward, which holds the result across a block's rows; a forward of one
// row per block, which does not, lost with it.
template <int VEC, typename W, typename C>
__device__ __forceinline__ void peeled_params(const W* __restrict__ p, cl_i64 a, int head,
                                              cl_i64 N, bool aligned, C fill, C (&out)[VEC]) {
  constexpr int NW = (int)(sizeof(W) * VEC / 4);  // 32-bit words per pack
  static_assert(sizeof(W) * VEC % 4 == 0 && (NW & (NW - 1)) == 0, "packs of 2^k words");
  if (p == nullptr) {
#pragma unroll
    for (int j = 0; j < VEC; ++j) out[j] = fill;
  } else if (aligned && a + 2 * VEC <= N) {
    typedef Pack<unsigned int, NW> Words;
    const Words lo = *reinterpret_cast<const Words*>(p + a);
    const Words hi = *reinterpret_cast<const Words*>(p + a + VEC);
    unsigned int w[2 * NW];
#pragma unroll
    for (int i = 0; i < NW; ++i) {
      w[i] = lo.v[i];
      w[NW + i] = hi.v[i];
    }
    const int bytes = head * (int)sizeof(W);
#pragma unroll
    for (int step = NW / 2; step >= 1; step /= 2) {  // down by (bytes / 4) words, a bit at a time
      const bool on = (bytes >> 2) & step;
#pragma unroll
      for (int i = 0; i + step < 2 * NW; ++i) w[i] = on ? w[i + step] : w[i];
    }
    union {
      Words w;
      Pack<W, VEC> p;
    } o;
    const int bits = (bytes & 3) * 8;  // 16 for an odd head of 16-bit parameters
#pragma unroll
    for (int i = 0; i < NW; ++i)
      o.w.v[i] = (unsigned int)((((unsigned long long)w[i + 1] << 32) | w[i]) >> bits);
#pragma unroll
    for (int j = 0; j < VEC; ++j) out[j] = (C)elem(o.p, j);
  } else {
#pragma unroll
    for (int j = 0; j < VEC; ++j) out[j] = (C)to_acc(p[a + head + j]);
  }
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
// a mask), other types are converted once (float16 conversions are not free: packed, it was
// slower).
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

// A thread's packs of a staged row read from shared memory where used (its slots, `stride`
// apart), not held in registers: what spilled there is read again from shared memory instead.
template <typename P> struct SmemRow {
  const P* base;
  int stride;
  __device__ __forceinline__ P operator[](int k) const { return base[k * stride]; }
};

// The cache line of `p` fetched into L2 (CUDA; elsewhere nothing): a later load there waits less.
__device__ __forceinline__ void prefetch_l2(const void* p) {
#if !defined(CLN_HIP)
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
#endif
}

// 16 bytes from global memory at `src` into shared memory at address `s`, or 16 zero bytes
// where not `ok` (src is then not read). .cg: a row is read once, L1 can be skipped.
__device__ __forceinline__ void copy16_async(unsigned int s, const void* src, bool ok) {
#if CLN_ASYNC_COPY
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(s), "l"(src),
               "r"(ok ? 16 : 0) : "memory");
#endif
}

// Copy NPT vectors of a row into shared memory (zero-filled outside [0, N) and for invalid rows:
// nothing is read there). Packs of 4, 8 or 16 bytes, or several 16-byte pieces. Per thread
// (PER_BLOCK false): into dst[k * blockDim.x * blockDim.y + tid], skipping L1 where it can. Per
// block (gamma, the same columns for every row of a block): the threads of row 0 copy into
// dst[k * blockDim.x + threadIdx.x] through L1; the other rows read those slots after a barrier.
// (Every thread copying gamma itself sent every block's copies of the same few lines to L2 at
// once, slower than reading gamma from global memory.)
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
      if constexpr (S == 16 && !PER_BLOCK)
        copy16_async(s + i, src + (ok ? i : 0), ok);
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

// The dynamic shared memory the launch gave (CUDA sm_80 on, where cp.async staging uses it).
__device__ __forceinline__ unsigned int dynamic_smem_bytes() {
  unsigned int have = 0;
#if CLN_ASYNC_COPY
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(have));
#endif
  return have;
}

// Traps when the launch gave less dynamic shared memory than `bytes` (a host/kernel mismatch
// would otherwise overrun it silently).
__device__ __forceinline__ void require_dynamic_smem(unsigned int bytes) {
#if CLN_ASYNC_COPY
  if (dynamic_smem_bytes() < bytes) cl_trap();
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

// One element of the fused add's h = x + res, rounded to H and stored to *h as load_row_add
// stores its vectors; returns it as stored.
template <typename T, typename H>
__device__ __forceinline__ typename Acc<H>::type add_elem(T x, H r, H* __restrict__ h) {
  const H v = Store<H>::cvt(to_acc(x) + to_acc(r));
  *h = v;
  return to_acc(v);
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

// The reductions' operation: a sum (the default), or the largest of values >= 0 (the quantized
// forward's amax; NaN ignored, 0 the identity as for sums).
struct ClSum {
  static constexpr bool sum = true;
};
struct ClMax {
  static constexpr bool sum = false;
  __device__ __forceinline__ static float op(float a, float b) { return fmaxf(a, b); }
};
template <typename Op, typename C> __device__ __forceinline__ void combine(C& a, C b) {
  if constexpr (Op::sum) a += b;  // as +=: through a call, float64 sums compiled differently
  else a = Op::op(a, b);
}

// The threads of a row: TPR where the kernel fixes it at compile time (its caller has checked
// the launch), else blockDim.x.
template <int TPR> __device__ __forceinline__ int row_threads() {
  return TPR ? TPR : (int)blockDim.x;
}

// Shuffle-only part: sum (Op) over the row's threads within one warp (all of the row when tpr <=
// WARP). Rows of whole warps take the unrolled butterfly (a loop on blockDim.x cost a compare and
// a branch per step on the row's critical path).
template <int WARP, int TPR = 0, typename Op = ClSum, int K, typename C>
__device__ __forceinline__ void warp_allreduce(C (&v)[K]) {
  if (row_threads<TPR>() >= WARP) {
#pragma unroll
    for (int o = WARP >> 1; o > 0; o >>= 1) {
#pragma unroll
      for (int k = 0; k < K; ++k) combine<Op>(v[k], shfl_xor(v[k], o));
    }
    return;
  }
  for (int o = row_threads<TPR>() >> 1; o > 0; o >>= 1) {
#pragma unroll
    for (int k = 0; k < K; ++k) combine<Op>(v[k], shfl_xor(v[k], o));
  }
}

// Sum over the row's threads. Rows of several warps exchange warp sums through shared memory
// with one barrier: `phase` alternates between consecutive calls (the caller's row counter), so
// a fast warp's next write goes to the other buffer while slow warps still read this one.
// TPR (> 0): the row's threads fixed at compile time (the row kernel), so the branches and the
// butterfly's trip count below are constants.
template <int WARP, int TPR = 0, typename Op = ClSum, int K, typename C>
__device__ __forceinline__ void row_allreduce(C (&v)[K], int phase) {
  __shared__ C red[2][K][1024 / WARP];
  warp_allreduce<WARP, TPR, Op>(v);
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
      for (int k = 0; k < K; ++k) combine<Op>(v[k], shfl_xor(v[k], o));
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

