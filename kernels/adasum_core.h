// Adasum arithmetic shared by the CPU core, the CUDA kernels and the TensorFlow adapter.
//
// This header includes no TensorFlow and no CUDA header, so the CUDA kernels build with plain nvcc
// and the CPU core can be tested without TensorFlow.
//
//   adasum(a, b) = (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b
#ifndef TF_ADASUM_KERNELS_ADASUM_CORE_H_
#define TF_ADASUM_KERNELS_ADASUM_CORE_H_

#include <cstdint>
#include <functional>

#if defined(__CUDACC__)
#define ADASUM_HOST_DEVICE __host__ __device__
#else
#define ADASUM_HOST_DEVICE
#endif

namespace adasum {

// sqrt(DBL_MIN). A squared norm below it is treated as zero and its coefficient is exactly 1: a zero
// vector then contributes nothing and leaves the other vector unchanged, and 0/0 never happens.
// Horovod's Adasum uses the same guard.
constexpr double kZeroNormGuard = 1.4916681462400413e-154;

// Scale factors for a and b given (a.b, |a|^2, |b|^2), all accumulated in float64.
ADASUM_HOST_DEVICE inline void AdasumCoefficients(double dot, double a_sq, double b_sq, double* ca,
                                                  double* cb) {
  *ca = a_sq >= kZeroNormGuard ? 1.0 - dot / (2.0 * a_sq) : 1.0;
  *cb = b_sq >= kZeroNormGuard ? 1.0 - dot / (2.0 * b_sq) : 1.0;
}

// float16 and bfloat16 are combined in float32, as docs/contract.md says, while both coefficients are at
// most this large in magnitude: products then stay far inside float32's range. Larger coefficients
// (bfloat16 inputs at scales 1e-20 and 1e20 give 1e39) are combined in float64 and rounded once.
constexpr double kFloat32CombineLimit = 4294967296.0;  // 2^32

ADASUM_HOST_DEVICE inline bool CombineInFloat32(double ca, double cb) {
  return (ca < 0 ? -ca : ca) <= kFloat32CombineLimit && (cb < 0 ? -cb : cb) <= kFloat32CombineLimit;
}

// Storage types for the two 16-bit floats. They are bit-compatible with Eigen::half,
// Eigen::bfloat16, __half and __nv_bfloat16, so the adapters reinterpret pointers.
struct Half {
  uint16_t bits;
};
struct BFloat16 {
  uint16_t bits;
};

// Work is cut into blocks of this many elements. The cut depends only on the tensor sizes, never on
// the number of threads, and partial sums are added in block order, so results are bitwise
// reproducible on any machine and thread count. 32K float32 elements is 128 KiB per operand, small
// enough to stay in L2 and large enough that a thread hand-off costs little against it.
constexpr int64_t kBlockElements = int64_t{1} << 15;

// Runs fn(begin, end) over [0, units), possibly on several threads. cost_per_unit is in cycles.
using ParallelFor =
    std::function<void(int64_t units, int64_t cost_per_unit, const std::function<void(int64_t, int64_t)>& fn)>;

// CPU core, for T in {Half, BFloat16, float, double}.
//
// dot_norms[3 * i + {0, 1, 2}] = (a_i.b_i, |a_i|^2, |b_i|^2), accumulated in float64.
template <typename T>
void DotNormsCpu(int n, const T* const* a, const T* const* b, const int64_t* sizes, double* dot_norms,
                 const ParallelFor& parallel_for);

// dst_i = src_i, and norms[i] = |src_i|^2 accumulated in float64: the same blocks and the same sum as
// DotNormsCpu(src, src), so the same bits, in one pass over memory.
template <typename T>
void CopyNormsCpu(int n, const T* const* src, const int64_t* sizes, T* const* dst, double* norms,
                  const ParallelFor& parallel_for);

// out_i = ca_i a_i + cb_i b_i, with coefficients from dot_norms. out_i may alias a_i or b_i. float32
// and float64 are combined in float64, the half types in float32 (see kFloat32CombineLimit); the
// result is rounded once on output.
template <typename T>
void CombineCpu(int n, const T* const* a, const T* const* b, const double* dot_norms, T* const* out,
                const int64_t* sizes, const ParallelFor& parallel_for);

}  // namespace adasum

#endif  // TF_ADASUM_KERNELS_ADASUM_CORE_H_
