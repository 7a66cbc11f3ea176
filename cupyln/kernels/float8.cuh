// Float32 to float8 (e4m3fn, e5m2) for the quantized forward's y: round to nearest even,
// saturating to the largest finite value (448, 57344; infinities too), NaN kept a NaN of its
// sign (0x7f, 0x7e), as ml_dtypes casts after a clip. Integer operations only, so that CUDA,
// HIP and a host compiler (tests/test_compile.py checks every float32 against ml_dtypes) give
// the same bits (sm_89 on: the hardware's conversion, the same bits but for NaN's, which keep
// this path); it needs __float_as_uint, __uint_as_float and __float2int_rn (and for
// ClDivisor __fmul_rn, fmaf, and __frcp_rn or, with CLN_HIP or CLN_HOST, float division).
#pragma once

// MBITS mantissa bits, exponent bias BIAS; MAXF/TINYF: the float32 bits of the largest finite
// value and of the smallest normal one; MAXQ/NANQ: the float8 bits of the largest finite value
// and of NaN.
template <int MBITS, int BIAS, unsigned MAXF, unsigned TINYF, unsigned MAXQ, unsigned NANQ>
__device__ __forceinline__ unsigned char cl_to_float8(float v) {
  const unsigned u = __float_as_uint(v);
  const unsigned sign = (u >> 24) & 0x80u;
  const unsigned a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return (unsigned char)(sign | NANQ);
  if (a >= MAXF) return (unsigned char)(sign | MAXQ);
  if (a < TINYF) {  // subnormal: a multiple of 2^(1 - BIAS - MBITS), found exactly by scaling
    const float steps = __uint_as_float(a) * (float)(1u << (BIAS - 1 + MBITS));
    return (unsigned char)(sign | (unsigned)__float2int_rn(steps));
  }
  constexpr int SHIFT = 23 - MBITS;  // float32 mantissa bits dropped
  const unsigned r = ((a + (1u << (SHIFT - 1)) - 1u + ((a >> SHIFT) & 1u)) >> SHIFT)
                     - ((127u - BIAS) << MBITS);
  return (unsigned char)(sign | (r > MAXQ ? MAXQ : r));
}

// E5M2: 0 for float8_e4m3fn, 1 for float8_e5m2 (the kernels' qflags bit 0).
__device__ __forceinline__ unsigned char cl_float8(float v, bool e5m2) {
  return e5m2 ? cl_to_float8<2, 15, 0x47600000u, 0x38800000u, 0x7bu, 0x7eu>(v)
              : cl_to_float8<3, 7, 0x43e00000u, 0x3c800000u, 0x7eu, 0x7fu>(v);
}

// Two float8 codes, a's in the low byte and b's in the high one: from the hardware's conversion
// where there is one (sm_89 on: one instruction for two, where cl_float8 takes about a dozen),
// which rounds and saturates as cl_float8 does; its NaN's bits are not ml_dtypes' (the sign, and
// e5m2's 0x7e), so a pair holding a NaN takes cl_float8. NANS = false: the caller knows neither
// is NaN (no test).
template <bool E5M2, bool NANS = true>
__device__ __forceinline__ unsigned cl_float8x2(float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890 && !defined(CLN_HIP)
  if (!NANS || (a == a && b == b)) {
    unsigned short r;  // cvt's first source goes to the high byte
    if constexpr (E5M2) asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(r) : "f"(b), "f"(a));
    else asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(b), "f"(a));
    return r;
  }
#endif
  return cl_float8(a, E5M2) | (unsigned)cl_float8(b, E5M2) << 8;
}

// max(a, b), NaN where either is NaN (fmaxf's opposite).
__device__ __forceinline__ float cl_max_nan(float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800 && !defined(CLN_HIP)
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
#else
  return a != a || b != b ? a + b : fmaxf(a, b);
#endif
}

// Quotients a / d of one divisor, correctly rounded (as IEEE division), without CUDA's division
// and its call to a slow path (the call made the kernels keep registers on the stack). d is
// scaled by a power of 2 into [1, 2), each dividend by the same, as two exact products (the
// power may pass float's range; a dividend the scaling overflows or flushes has a quotient
// that a float8 saturates or flushes as well); the product by the scaled divisor's rounded
// reciprocal is then corrected twice by its exact remainder (Markstein), with the product's
// sign (a zero's too). A non-finite product stays (d infinite: 0).
struct ClDivisor {
  float b, r, p1, p2;
  __device__ __forceinline__ explicit ClDivisor(float d) {
    const bool sub = (__float_as_uint(d) & 0x7f800000u) == 0;  // subnormal (or 0): 2^64 first
    const int e = (int)((__float_as_uint(sub ? d * 0x1p64f : d) >> 23) & 0xffu);
    const int k = 127 - e + (sub ? 64 : 0), k1 = k / 2;  // d * 2^k in [1, 2)
    p1 = __uint_as_float((unsigned)(k1 + 127) << 23);
    p2 = __uint_as_float((unsigned)(k - k1 + 127) << 23);
    b = d * p1 * p2;
#if defined(CLN_HIP) || defined(CLN_HOST)
    r = 1.0f / b;
#else
    r = __frcp_rn(b);
#endif
  }
  __device__ __forceinline__ float operator()(float a) const {
    a = __fmul_rn(__fmul_rn(a, p1), p2);
    const float q0 = __fmul_rn(a, r);
    const float q1 = fmaf(fmaf(-q0, b, a), r, q0);
    const float q2 = fmaf(fmaf(-q1, b, a), r, q1);
    return fabsf(q0) < __uint_as_float(0x7f800000u) && r != 0.0f ? copysignf(q2, q0) : q0;
  }
};

// a / d as a times d's reciprocal, for float8 codes: two multiplies, by ClDivisor's rounded
// reciprocal of the scaled divisor times one of its powers of 2, then by the other (the first
// product lies about between a and the quotient, so it overflows or flushes only where the
// quotient does, or a is subnormal). Within 1.5 float32 ulps of the correctly rounded
// quotient, so a code differs from the quotient's only where a tie between two codes lies
// between them. A NaN divisor gives NaN.
struct ClReciprocal {
  float rp1, p2;
  ClReciprocal() = default;
  __device__ __forceinline__ explicit ClReciprocal(const ClDivisor& d) : rp1(d.r * d.p1), p2(d.p2) {}
  __device__ __forceinline__ float operator()(float a) const { return __fmul_rn(a, rp1) * p2; }
};
