// CPU core of the Adasum ops. No TensorFlow header: the adapter passes raw pointers and a
// ParallelFor backed by TensorFlow's CPU thread pool.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "adasum_core.h"

#if defined(__SSE__)
#include <immintrin.h>
#endif

namespace adasum {
namespace {

// Eight independent accumulators per quantity. They let the compiler keep the float64 sums in
// vector registers without reassociating (no -ffast-math), so the result does not depend on the
// compiler's vectorization choices.
constexpr int kLanes = 8;

// Below this many elements in a whole call, the thread hand-off costs more than it saves.
constexpr int64_t kMinParallelElements = int64_t{1} << 17;

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
  if (back != d && std::isfinite(f)) {
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

// A float32 call whose output is at least this large writes it with non-temporal stores (with AVX;
// other dtypes ignore it): the output then costs no read of its old contents and does not push the
// inputs out of the last-level cache. Smaller outputs stay in cache for whatever reads them next.
constexpr int64_t kStreamingBytes = int64_t{8} << 20;

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

#if defined(__F16C__) && defined(__AVX2__)
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

// The float32 path for the half types. The vector and scalar loops round identically (products and
// sum in float32, no FMA, one round-to-nearest-even on output).
template <typename T>
void CombineSpanFloat32(const T* a, const T* b, float ca, float cb, T* out, int64_t n) {
  int64_t i = 0;
#if defined(__F16C__) && defined(__AVX2__)
  const __m256 vca = _mm256_set1_ps(ca), vcb = _mm256_set1_ps(cb);
  for (; i + 8 <= n; i += 8) {
    Store8(_mm256_add_ps(_mm256_mul_ps(vca, Load8(a + i)), _mm256_mul_ps(vcb, Load8(b + i))), out + i);
  }
#endif
  for (; i < n; ++i) FromFloat(ca * ToFloat(a[i]) + cb * ToFloat(b[i]), out + i);
}

template <typename T>
constexpr bool kIsHalfType = std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>;

// float32 and float64 are combined in float64; the half types in float32 while the coefficients allow.
template <typename T>
void CombineSpan(const T* a, const T* b, double ca, double cb, T* out, int64_t n, bool stream) {
  if constexpr (kIsHalfType<T>) {
    if (CombineInFloat32(ca, cb)) {
      CombineSpanFloat32(a, b, static_cast<float>(ca), static_cast<float>(cb), out, n);
      return;
    }
  }
  CombineSpanFloat64(a, b, ca, cb, out, n, stream);
}

// TensorFlow runs kernels with flush-to-zero and denormals-are-zero set. Adasum must keep values near
// the smallest normal (bfloat16 and float32 inputs near finfo.tiny are subnormal once combined), so the
// core restores IEEE gradual underflow on each thread for the duration of its work.
class ScopedGradualUnderflow {
 public:
#if defined(__SSE__)
  ScopedGradualUnderflow() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ & ~(kFlushToZero | kDenormalsAreZero)); }
  ~ScopedGradualUnderflow() { _mm_setcsr(saved_); }

 private:
  static constexpr unsigned kFlushToZero = 0x8000;
  static constexpr unsigned kDenormalsAreZero = 0x0040;
  unsigned saved_;
#endif
};

struct Block {
  int tensor;
  int64_t begin;
  int64_t end;
};

std::vector<Block> CutIntoBlocks(int n, const int64_t* sizes, int64_t* total) {
  std::vector<Block> blocks;
  *total = 0;
  for (int t = 0; t < n; ++t) {
    for (int64_t begin = 0; begin < sizes[t]; begin += kBlockElements) {
      blocks.push_back({t, begin, begin + kBlockElements < sizes[t] ? begin + kBlockElements : sizes[t]});
    }
    *total += sizes[t];
  }
  return blocks;
}

void RunBlocks(int64_t total_elements, int64_t n_blocks, int64_t cycles_per_element,
               const ParallelFor& parallel_for, const std::function<void(int64_t, int64_t)>& fn) {
  auto with_gradual_underflow = [&fn](int64_t first, int64_t last) {
    ScopedGradualUnderflow guard;
    fn(first, last);
  };
  if (total_elements < kMinParallelElements || !parallel_for) {
    with_gradual_underflow(0, n_blocks);
  } else {
    parallel_for(n_blocks, kBlockElements * cycles_per_element, with_gradual_underflow);
  }
}

}  // namespace

// Runs span(block, partial) over every block of the tensors, in parallel, where `partial` receives the
// block's three sums; returns them summed per tensor ([n, 3]), in block order, so the result does not
// depend on the threads.
template <typename Span>
std::vector<double> SumOverBlocks(int n, const int64_t* sizes, const ParallelFor& parallel_for, Span span) {
  int64_t total = 0;
  const std::vector<Block> blocks = CutIntoBlocks(n, sizes, &total);
  std::vector<double> partial(3 * blocks.size());
  RunBlocks(total, static_cast<int64_t>(blocks.size()), 2, parallel_for, [&](int64_t first, int64_t last) {
    for (int64_t k = first; k < last; ++k) span(blocks[k], &partial[3 * k]);
  });
  std::vector<double> sums(3 * n, 0.0);
  for (size_t k = 0; k < blocks.size(); ++k) {
    for (int q = 0; q < 3; ++q) sums[3 * blocks[k].tensor + q] += partial[3 * k + q];
  }
  return sums;
}

template <typename T>
void DotNormsCpu(int n, const T* const* a, const T* const* b, const int64_t* sizes, double* dot_norms,
                 const ParallelFor& parallel_for) {
  const std::vector<double> sums = SumOverBlocks(n, sizes, parallel_for, [&](const Block& blk, double* out) {
    DotNormsSpan(a[blk.tensor] + blk.begin, b[blk.tensor] + blk.begin, blk.end - blk.begin, out);
  });
  std::copy(sums.begin(), sums.end(), dot_norms);
}

template <typename T>
void CombineCpu(int n, const T* const* a, const T* const* b, const double* dot_norms, T* const* out,
                const int64_t* sizes, const ParallelFor& parallel_for) {
  int64_t total = 0;
  const std::vector<Block> blocks = CutIntoBlocks(n, sizes, &total);
  std::vector<double> coefficients(2 * n);
  for (int t = 0; t < n; ++t) {
    AdasumCoefficients(dot_norms[3 * t], dot_norms[3 * t + 1], dot_norms[3 * t + 2], &coefficients[2 * t],
                       &coefficients[2 * t + 1]);
  }
  const bool stream = total * static_cast<int64_t>(sizeof(T)) >= kStreamingBytes;
  RunBlocks(total, static_cast<int64_t>(blocks.size()), 2, parallel_for, [&](int64_t first, int64_t last) {
    for (int64_t k = first; k < last; ++k) {
      const Block& blk = blocks[k];
      CombineSpan(a[blk.tensor] + blk.begin, b[blk.tensor] + blk.begin, coefficients[2 * blk.tensor],
                  coefficients[2 * blk.tensor + 1], out[blk.tensor] + blk.begin, blk.end - blk.begin, stream);
    }
  });
}

template <typename T>
void CopyNormsCpu(int n, const T* const* src, const int64_t* sizes, T* const* dst, double* norms,
                  const ParallelFor& parallel_for) {
  const std::vector<double> sums = SumOverBlocks(n, sizes, parallel_for, [&](const Block& blk, double* out) {
    T* copy = dst[blk.tensor] + blk.begin;
    std::memcpy(copy, src[blk.tensor] + blk.begin, (blk.end - blk.begin) * sizeof(T));
    // The block was just written, so it is read back from cache: one pass over memory.
    DotNormsSpan<T>(copy, copy, blk.end - blk.begin, out);
  });
  for (int t = 0; t < n; ++t) norms[t] = sums[3 * t + 1];
}

#define ADASUM_INSTANTIATE(T)                                                                            \
  template void CopyNormsCpu<T>(int, const T* const*, const int64_t*, T* const*, double*,              \
                                const ParallelFor&);                                                     \
  template void DotNormsCpu<T>(int, const T* const*, const T* const*, const int64_t*, double*,          \
                               const ParallelFor&);                                                      \
  template void CombineCpu<T>(int, const T* const*, const T* const*, const double*, T* const*,          \
                              const int64_t*, const ParallelFor&);
ADASUM_INSTANTIATE(Half)
ADASUM_INSTANTIATE(BFloat16)
ADASUM_INSTANTIATE(float)
ADASUM_INSTANTIATE(double)
#undef ADASUM_INSTANTIATE

}  // namespace adasum
