// The hot loops of the CPU core over one contiguous span, for one CPU path (kernels/adasum_cpu_path.h).
//
// setup.py compiles this file once per path with -DADASUM_CPU_PATH=<name> and the path's -m flags; the
// intrinsics below are chosen by what those flags enable. Everything here has internal linkage but the
// path's table, so no path's code can stand in for another's (see adasum_cpu_path.h). No TensorFlow
// header, and no library call but memcpy.
//
// The bits do not depend on the path. Sums of products are accumulated in eight float64 lanes in a
// fixed order; float16 and bfloat16 widen exactly; every product, sum and narrowing is one IEEE
// operation rounded to nearest even, never contracted into an FMA; the vector conversions round as the
// scalar ones do (tests/test_cpu_paths.py checks every path this CPU has against the others).
#include <cstdint>
#include <cstring>

#include "adasum_core.h"
#include "adasum_cpu_path.h"

#if defined(__SSE2__)
#include <immintrin.h>
#endif

#ifndef ADASUM_CPU_PATH
#error "build with -DADASUM_CPU_PATH=<path name> (setup.py does this)"
#endif
#define ADASUM_STRINGIFY_(x) #x
#define ADASUM_STRINGIFY(x) ADASUM_STRINGIFY_(x)

#if defined(__F16C__) && defined(__AVX2__)
#define ADASUM_AVX2_CONVERSIONS 1
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define ADASUM_AVX512_CONVERSIONS 1
#endif

namespace adasum {
namespace {

// Eight independent accumulators per quantity. They let the compiler keep the float64 sums in
// vector registers without reassociating (no -ffast-math), so the result does not depend on the
// compiler's vectorization choices.
constexpr int kLanes = 8;

inline float BFloat16ToFloat(BFloat16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.bits) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline BFloat16 FloatToBFloat16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return BFloat16{static_cast<uint16_t>((bits >> 16) | 0x40u)};
  bits += 0x7fffu + ((bits >> 16) & 1u);  // round to nearest even
  return BFloat16{static_cast<uint16_t>(bits >> 16)};
}

inline float HalfToFloat(Half x) {
#if defined(__F16C__)
  return _cvtsh_ss(x.bits);
#else
  const uint32_t sign = static_cast<uint32_t>(x.bits & 0x8000u) << 16;
  const uint32_t exponent = (x.bits >> 10) & 0x1fu;
  const uint32_t mantissa = x.bits & 0x3ffu;
  uint32_t bits;
  if (exponent == 0) {
    const float f = static_cast<float>(mantissa) * 5.9604644775390625e-8f;  // subnormal: m * 2^-24
    std::memcpy(&bits, &f, sizeof(bits));
    bits |= sign;
  } else if (exponent == 31) {
    bits = sign | 0x7f800000u | (mantissa << 13);
  } else {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
#endif
}

inline Half FloatToHalf(float f) {
#if defined(__F16C__)
  return Half{static_cast<uint16_t>(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT))};
#else
  // Round to nearest even without a hardware converter (after F. Giesen's float_to_half_fast3_rtne).
  uint32_t x;
  std::memcpy(&x, &f, sizeof(x));
  const uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u) return Half{static_cast<uint16_t>(sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u : 0u))};
  if (ax >= 0x477ff000u) return Half{static_cast<uint16_t>(sign | 0x7c00u)};  // >= 65520 rounds to inf
  if (ax < 0x38800000u) {
    // Result is subnormal: adding 0.5 puts the half's ulp (2^-24) at the float's ulp, and the FPU
    // rounds to nearest even for us.
    float af;
    std::memcpy(&af, &ax, sizeof(af));
    af += 0.5f;
    uint32_t r;
    std::memcpy(&r, &af, sizeof(r));
    return Half{static_cast<uint16_t>(sign | (r - 0x3f000000u))};
  }
  const uint32_t odd = (ax >> 13) & 1u;
  ax += (static_cast<uint32_t>(15 - 127) << 23) + 0xfffu + odd;
  return Half{static_cast<uint16_t>(sign | (ax >> 13))};
#endif
}

// Rounds to float with round-to-odd. Rounding that result to a type of at most 22 significant bits
// (half, bfloat16) then equals one correct rounding of d: no double-rounding error.
inline float RoundToOddFloat(double d) {
  float f = static_cast<float>(d);
  const double back = static_cast<double>(f);
  if (back != d && __builtin_isfinite(f)) {
    uint32_t bits;
    std::memcpy(&bits, &f, sizeof(bits));
    if ((back > 0 ? back : -back) > (d > 0 ? d : -d)) bits -= 1;  // rounded away from zero: truncate
    bits |= 1u;
    std::memcpy(&f, &bits, sizeof(f));
  }
  return f;
}

// Per storage type: conversions to and from float64. Every dtype can be combined in float64; the half
// types normally take the float32 path below instead.
template <typename T>
struct Element;

template <>
struct Element<double> {
  static double Load(double x) { return x; }
  static double Store(double x) { return x; }
};

template <>
struct Element<float> {
  static double Load(float x) { return x; }
  static float Store(double x) { return static_cast<float>(x); }
};

template <>
struct Element<BFloat16> {
  static double Load(BFloat16 x) { return BFloat16ToFloat(x); }
  static BFloat16 Store(double x) { return FloatToBFloat16(RoundToOddFloat(x)); }
};

template <>
struct Element<Half> {
  static double Load(Half x) { return HalfToFloat(x); }
  static Half Store(double x) { return FloatToHalf(RoundToOddFloat(x)); }
};

// Widens kLanes consecutive elements to float64.
template <typename T>
inline void LoadLanes(const T* p, double* out) {
  for (int j = 0; j < kLanes; ++j) out[j] = Element<T>::Load(p[j]);
}

#if defined(__F16C__)
template <>
inline void LoadLanes<Half>(const Half* p, double* out) {
  static_assert(kLanes == 8, "one F16C conversion covers 8 halves");
  float f[kLanes];
  _mm256_storeu_ps(f, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  for (int j = 0; j < kLanes; ++j) out[j] = f[j];
}
#endif

template <typename T>
void DotNormsSpan(const T* a, const T* b, int64_t n, double* result) {
  double dot[kLanes] = {}, a_sq[kLanes] = {}, b_sq[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    double x[kLanes], y[kLanes];
    LoadLanes(a + i, x);
    LoadLanes(b + i, y);
    for (int j = 0; j < kLanes; ++j) {
      dot[j] += x[j] * y[j];
      a_sq[j] += x[j] * x[j];
      b_sq[j] += y[j] * y[j];
    }
  }
  for (int j = 0; i < n; ++i, ++j) {
    const double x = Element<T>::Load(a[i]), y = Element<T>::Load(b[i]);
    dot[j] += x * y;
    a_sq[j] += x * x;
    b_sq[j] += y * y;
  }
  result[0] = result[1] = result[2] = 0.0;
  for (int j = 0; j < kLanes; ++j) {
    result[0] += dot[j];
    result[1] += a_sq[j];
    result[2] += b_sq[j];
  }
}

template <typename T>
void CombineSpanFloat64(const T* a, const T* b, double ca, double cb, T* out, int64_t n, bool /*stream*/) {
  for (int64_t i = 0; i < n; ++i) {
    out[i] = Element<T>::Store(ca * Element<T>::Load(a[i]) + cb * Element<T>::Load(b[i]));
  }
}

#if defined(__AVX__)
// float32 combined in float64. With `stream`, eight lanes at a time with the scalar loop's operations
// (widen, two products, one sum, one rounding to float; no FMA), so the same bits, the output streamed
// past the caches.
template <>
inline void CombineSpanFloat64<float>(const float* a, const float* b, double ca, double cb, float* out, int64_t n,
                                      bool stream) {
  const __m256d vca = _mm256_set1_pd(ca), vcb = _mm256_set1_pd(cb);
  auto half = [&](__m128 x, __m128 y) {
    return _mm256_cvtpd_ps(_mm256_add_pd(_mm256_mul_pd(vca, _mm256_cvtps_pd(x)), _mm256_mul_pd(vcb, _mm256_cvtps_pd(y))));
  };
  auto eight = [&](int64_t k) {
    const __m256 x = _mm256_loadu_ps(a + k), y = _mm256_loadu_ps(b + k);
    const __m128 lo = half(_mm256_castps256_ps128(x), _mm256_castps256_ps128(y));
    const __m128 hi = half(_mm256_extractf128_ps(x, 1), _mm256_extractf128_ps(y, 1));
    return _mm256_insertf128_ps(_mm256_castps128_ps256(lo), hi, 1);
  };
  auto one = [&](int64_t k) { out[k] = static_cast<float>(ca * static_cast<double>(a[k]) + cb * static_cast<double>(b[k])); };
  if (!stream) {  // the compiler's own vectorisation of the scalar loop
    for (int64_t i = 0; i < n; ++i) one(i);
    return;
  }
  int64_t i = 0;
  for (; i < n && (reinterpret_cast<uintptr_t>(out + i) & 31) != 0; ++i) one(i);
  for (; i + 8 <= n; i += 8) _mm256_stream_ps(out + i, eight(i));
  _mm_sfence();  // the streamed stores are visible before the op completes
  for (; i < n; ++i) one(i);
}
#endif

inline float ToFloat(Half x) { return HalfToFloat(x); }
inline float ToFloat(BFloat16 x) { return BFloat16ToFloat(x); }
inline void FromFloat(float x, Half* out) { *out = FloatToHalf(x); }
inline void FromFloat(float x, BFloat16* out) { *out = FloatToBFloat16(x); }

#if defined(ADASUM_AVX2_CONVERSIONS)
inline __m256 Load8(const Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

inline void Store8(__m256 v, Half* p) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}

inline __m256 Load8(const BFloat16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

// Eight lanes of FloatToBFloat16: round to nearest even, NaN kept quiet.
inline void Store8(__m256 v, BFloat16* p) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd));
  const __m256i quiet_nan = _mm256_or_si256(bits, _mm256_set1_epi32(0x00400000));
  const __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  const __m256i top = _mm256_srli_epi32(_mm256_blendv_epi8(rounded, quiet_nan, is_nan), 16);
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(top), _mm256_extracti128_si256(top, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}
#endif

#if defined(ADASUM_AVX512_CONVERSIONS)
inline __m512 Load16(const Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

inline void Store16(__m512 v, Half* p) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}

inline __m512 Load16(const BFloat16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// Sixteen lanes of FloatToBFloat16 in integer arithmetic: round to nearest even, NaN kept quiet.
inline __m256i RoundToBFloat16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd));
  const __mmask16 is_nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  const __m512i chosen = _mm512_mask_or_epi32(rounded, is_nan, bits, _mm512_set1_epi32(0x00400000));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(chosen, 16));
}

inline void Store16(__m512 v, BFloat16* p) {
#if defined(__AVX512BF16__)
  // vcvtneps2bf16 rounds to nearest even and keeps NaN quiet as above, but reads a subnormal float as
  // zero (whatever MXCSR says). Lanes holding one (exponent 0, mantissa not: rare) take the integer
  // rounding instead.
  const __m256bh converted = _mm512_cvtneps_pbh(v);
  __m256i out;
  std::memcpy(&out, &converted, sizeof(out));
  const __m512i bits = _mm512_castps_si512(v);
  const __mmask16 subnormal = _mm512_testn_epi32_mask(bits, _mm512_set1_epi32(0x7f800000)) &
                              _mm512_test_epi32_mask(bits, _mm512_set1_epi32(0x007fffff));
  if (subnormal) out = _mm256_mask_blend_epi16(subnormal, out, RoundToBFloat16(v));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), out);
#else
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), RoundToBFloat16(v));
#endif
}
#endif

// The float32 path for the half types. The vector and scalar loops round identically (products and
// sum in float32, no FMA, one round-to-nearest-even on output).
template <typename T>
void CombineSpanFloat32(const T* a, const T* b, float ca, float cb, T* out, int64_t n) {
  int64_t i = 0;
#if defined(ADASUM_AVX512_CONVERSIONS)
  const __m512 wca = _mm512_set1_ps(ca), wcb = _mm512_set1_ps(cb);
  for (; i + 16 <= n; i += 16) {
    Store16(_mm512_add_ps(_mm512_mul_ps(wca, Load16(a + i)), _mm512_mul_ps(wcb, Load16(b + i))), out + i);
  }
#endif
#if defined(ADASUM_AVX2_CONVERSIONS)
  const __m256 vca = _mm256_set1_ps(ca), vcb = _mm256_set1_ps(cb);
  for (; i + 8 <= n; i += 8) {
    Store8(_mm256_add_ps(_mm256_mul_ps(vca, Load8(a + i)), _mm256_mul_ps(vcb, Load8(b + i))), out + i);
  }
#endif
  for (; i < n; ++i) FromFloat(ca * ToFloat(a[i]) + cb * ToFloat(b[i]), out + i);
}

// The table's entries: the loops above on untyped pointers.
template <typename T>
void DotNorms(const void* a, const void* b, int64_t n, double* result) {
  DotNormsSpan(static_cast<const T*>(a), static_cast<const T*>(b), n, result);
}

template <typename T>
void Combine64(const void* a, const void* b, double ca, double cb, void* out, int64_t n, bool stream) {
  CombineSpanFloat64(static_cast<const T*>(a), static_cast<const T*>(b), ca, cb, static_cast<T*>(out), n, stream);
}

template <typename T>
void Combine32(const void* a, const void* b, float ca, float cb, void* out, int64_t n) {
  CombineSpanFloat32(static_cast<const T*>(a), static_cast<const T*>(b), ca, cb, static_cast<T*>(out), n);
}

}  // namespace

namespace cpu_paths {
// In the order of the dtype codes of adasum_dtypes.h: float16, bfloat16, float32, float64.
const CpuPath ADASUM_CPU_PATH = {
    ADASUM_STRINGIFY(ADASUM_CPU_PATH),
    {DotNorms<Half>, DotNorms<BFloat16>, DotNorms<float>, DotNorms<double>},
    {Combine64<Half>, Combine64<BFloat16>, Combine64<float>, Combine64<double>},
    {Combine32<Half>, Combine32<BFloat16>},
};
}  // namespace cpu_paths

}  // namespace adasum
