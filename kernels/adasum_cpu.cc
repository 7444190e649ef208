// CPU core of the Adasum ops. No TensorFlow header: the adapter passes raw pointers and a
// ParallelFor backed by TensorFlow's CPU thread pool.
//
// This file is built for the architecture's baseline. It cuts the work into fixed blocks, runs them on
// threads, adds the blocks' partial sums in block order, and calls the hot loops of the CPU path chosen
// at run time (kernels/adasum_cpu_path.h): the widest instruction set this CPU has, or the one that
// $TF_ADASUM_CPU_PATH or tf_adasum_set_cpu_path names.
#include <algorithm>
#include <atomic>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "adasum_core.h"
#include "adasum_cpu_path.h"
#include "adasum_dtypes.h"

#if defined(__SSE__)
#include <immintrin.h>
#endif
#if defined(__x86_64__) && !defined(ADASUM_CPU_PATH_CUSTOM)
#include <cpuid.h>
#endif

// What setup.py built, as JSON: the compiler, each translation unit's flags, the TensorFlow version.
#if __has_include("adasum_build_info.h")
#include "adasum_build_info.h"
#else
#define TF_ADASUM_BUILD_INFO "{}"
#endif

namespace adasum {
namespace {

static_assert(ADASUM_FLOAT16 == 0 && ADASUM_BFLOAT16 == 1 && ADASUM_FLOAT32 == 2 && ADASUM_FLOAT64 == 3,
              "CpuPath's tables are indexed by these codes");

template <typename T>
constexpr int kDtypeCode = std::is_same_v<T, Half>       ? ADASUM_FLOAT16
                           : std::is_same_v<T, BFloat16> ? ADASUM_BFLOAT16
                           : std::is_same_v<T, float>    ? ADASUM_FLOAT32
                                                         : ADASUM_FLOAT64;

// ---------------------------------------------------------------------------------------------------
// Choosing the path.

struct PathEntry {
  const CpuPath* path;
  bool supported;  // this CPU (and its operating system) can run it
};

#if defined(__x86_64__) && !defined(ADASUM_CPU_PATH_CUSTOM)
struct X86Features {
  bool avx2 = false;        // with FMA and F16C, and YMM state enabled by the OS
  bool avx512 = false;      // F, DQ, BW, VL, and ZMM state enabled by the OS
  bool avx512bf16 = false;  // AVX512_BF16
};

// From CPUID and XGETBV directly (not __builtin_cpu_supports): the same answer under g++ and clang, and
// the operating system's consent to the wide registers is part of it.
X86Features DetectX86() {
  X86Features f;
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return f;
  const bool fma = ecx & (1u << 12), osxsave = ecx & (1u << 27), avx = ecx & (1u << 28), f16c = ecx & (1u << 29);
  if (!(osxsave && avx)) return f;
  unsigned xcr0, xcr0_high;
  __asm__ volatile("xgetbv" : "=a"(xcr0), "=d"(xcr0_high) : "c"(0));
  const bool ymm_state = (xcr0 & 0x06) == 0x06;  // SSE and AVX state
  const bool zmm_state = (xcr0 & 0xe6) == 0xe6;  // and the opmask, ZMM_Hi256 and Hi16_ZMM state
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return f;
  const unsigned leaf7_subleaves = eax;
  const bool avx2 = ebx & (1u << 5);
  const bool avx512 = (ebx & (1u << 16)) && (ebx & (1u << 17)) && (ebx & (1u << 30)) && (ebx & (1u << 31));
  f.avx2 = ymm_state && avx2 && fma && f16c;
  f.avx512 = f.avx2 && zmm_state && avx512;
  if (f.avx512 && leaf7_subleaves >= 1 && __get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx)) {
    f.avx512bf16 = eax & (1u << 5);
  }
  return f;
}
#endif

// Every path this library holds, narrowest first.
const std::vector<PathEntry>& Paths() {
  static const std::vector<PathEntry> paths = [] {
#if defined(ADASUM_CPU_PATH_CUSTOM)
    return std::vector<PathEntry>{{&cpu_paths::custom, true}};
#elif defined(__x86_64__)
    const X86Features f = DetectX86();
    return std::vector<PathEntry>{{&cpu_paths::portable, true},
                                  {&cpu_paths::avx2, f.avx2},
                                  {&cpu_paths::avx512, f.avx512},
                                  {&cpu_paths::avx512bf16, f.avx512bf16}};
#else
    return std::vector<PathEntry>{{&cpu_paths::portable, true}};
#endif
  }();
  return paths;
}

const CpuPath* WidestSupported() {
  const CpuPath* widest = nullptr;
  for (const PathEntry& entry : Paths()) {
    if (entry.supported) widest = entry.path;
  }
  return widest;
}

std::atomic<const CpuPath*> active_path{nullptr};

// One load per call: a call runs wholly on one path even if another thread switches paths meanwhile.
const CpuPath& ActivePath() {
  const CpuPath* path = active_path.load(std::memory_order_acquire);
  if (path == nullptr) {
    const CpuPath* expected = nullptr;
    active_path.compare_exchange_strong(expected, WidestSupported(), std::memory_order_acq_rel);
    path = active_path.load(std::memory_order_acquire);
  }
  return *path;
}

// ---------------------------------------------------------------------------------------------------
// Blocks and threads.

// Below this many elements in a whole call, the thread hand-off costs more than it saves.
constexpr int64_t kMinParallelElements = int64_t{1} << 17;

// A float32 call whose output is at least this large writes it with non-temporal stores (on paths with
// AVX; other dtypes ignore it): the output then costs no read of its old contents and does not push the
// inputs out of the last-level cache. Smaller outputs stay in cache for whatever reads them next.
constexpr int64_t kStreamingBytes = int64_t{8} << 20;

// TensorFlow runs kernels with flush-to-zero and denormals-are-zero set (FZ on Arm). Adasum must keep
// values near the smallest normal (bfloat16 and float32 inputs near finfo.tiny are subnormal once
// combined), so the core restores IEEE gradual underflow for the duration of its work: on the calling
// thread for the whole call (the blocks' partial sums are added there, and a subnormal partial sum
// would otherwise read as zero), and on each pool thread for its blocks.
class ScopedGradualUnderflow {
 public:
#if defined(__SSE__)
  ScopedGradualUnderflow() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ & ~(kFlushToZero | kDenormalsAreZero)); }
  ~ScopedGradualUnderflow() { _mm_setcsr(saved_); }

 private:
  static constexpr unsigned kFlushToZero = 0x8000;
  static constexpr unsigned kDenormalsAreZero = 0x0040;
  unsigned saved_;
#elif defined(__aarch64__)
  ScopedGradualUnderflow() {
    __asm__ volatile("mrs %0, fpcr" : "=r"(saved_));
    const uint64_t gradual = saved_ & ~(kFlushToZero | kFlushToZero16);
    __asm__ volatile("msr fpcr, %0" : : "r"(gradual));
  }
  ~ScopedGradualUnderflow() { __asm__ volatile("msr fpcr, %0" : : "r"(saved_)); }

 private:
  static constexpr uint64_t kFlushToZero = uint64_t{1} << 24;
  static constexpr uint64_t kFlushToZero16 = uint64_t{1} << 19;
  uint64_t saved_;
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

}  // namespace

template <typename T>
void DotNormsCpu(int n, const T* const* a, const T* const* b, const int64_t* sizes, double* dot_norms,
                 const ParallelFor& parallel_for) {
  ScopedGradualUnderflow guard;
  const auto span = ActivePath().dot_norms[kDtypeCode<T>];
  const std::vector<double> sums = SumOverBlocks(n, sizes, parallel_for, [&](const Block& blk, double* out) {
    span(a[blk.tensor] + blk.begin, b[blk.tensor] + blk.begin, blk.end - blk.begin, out);
  });
  std::copy(sums.begin(), sums.end(), dot_norms);
}

template <typename T>
void CombineCpu(int n, const T* const* a, const T* const* b, const double* dot_norms, T* const* out,
                const int64_t* sizes, const ParallelFor& parallel_for) {
  ScopedGradualUnderflow guard;
  const CpuPath& path = ActivePath();
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
      const double ca = coefficients[2 * blk.tensor], cb = coefficients[2 * blk.tensor + 1];
      const T* pa = a[blk.tensor] + blk.begin;
      const T* pb = b[blk.tensor] + blk.begin;
      T* po = out[blk.tensor] + blk.begin;
      const int64_t count = blk.end - blk.begin;
      // float32 and float64 are combined in float64; the half types in float32 while the coefficients
      // allow (adasum_core.h).
      if constexpr (std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>) {
        if (CombineInFloat32(ca, cb)) {
          path.combine32[kDtypeCode<T>](pa, pb, static_cast<float>(ca), static_cast<float>(cb), po, count);
          continue;
        }
      }
      path.combine64[kDtypeCode<T>](pa, pb, ca, cb, po, count, stream);
    }
  });
}

template <typename T>
void CopyNormsCpu(int n, const T* const* src, const int64_t* sizes, T* const* dst, double* norms,
                  const ParallelFor& parallel_for) {
  ScopedGradualUnderflow guard;
  const auto span = ActivePath().dot_norms[kDtypeCode<T>];
  const std::vector<double> sums = SumOverBlocks(n, sizes, parallel_for, [&](const Block& blk, double* out) {
    T* copy = dst[blk.tensor] + blk.begin;
    std::memcpy(copy, src[blk.tensor] + blk.begin, (blk.end - blk.begin) * sizeof(T));
    // The block was just written, so it is read back from cache: one pass over memory.
    span(copy, copy, blk.end - blk.begin, out);
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

extern "C" {

// The path the CPU ops run on now.
const char* tf_adasum_cpu_path() { return adasum::ActivePath().name; }

// Every path this library holds, narrowest first, as "name:1" (this CPU runs it) or "name:0", joined by
// commas: "portable:1,avx2:1,avx512:0,avx512bf16:0".
const char* tf_adasum_cpu_paths() {
  static const std::string listing = [] {
    std::string joined;
    for (const adasum::PathEntry& entry : adasum::Paths()) {
      if (!joined.empty()) joined += ',';
      joined += entry.path->name;
      joined += entry.supported ? ":1" : ":0";
    }
    return joined;
  }();
  return listing.c_str();
}

// Runs the CPU ops on the path `name` from now on; a null or empty name chooses the widest this CPU
// runs. Returns 0; -1 when the library holds no such path; -2 when this CPU cannot run it.
int tf_adasum_set_cpu_path(const char* name) {
  if (name == nullptr || *name == '\0') {
    adasum::active_path.store(adasum::WidestSupported(), std::memory_order_release);
    return 0;
  }
  for (const adasum::PathEntry& entry : adasum::Paths()) {
    if (std::strcmp(entry.path->name, name) == 0) {
      if (!entry.supported) return -2;
      adasum::active_path.store(entry.path, std::memory_order_release);
      return 0;
    }
  }
  return -1;
}

// How this library was built, as JSON (setup.py writes it): compiler, flags per translation unit,
// TensorFlow version.
const char* tf_adasum_build_info() { return TF_ADASUM_BUILD_INFO; }

}  // extern "C"
