// The CPU paths: the hot loops of the CPU core, compiled once per instruction set and chosen at run time.
//
// kernels/adasum_cpu_path.cc holds the loops over one contiguous span (dot product and norms, combine).
// setup.py compiles it once per path, each time with -DADASUM_CPU_PATH=<name> and that path's -m flags;
// kernels/adasum_cpu.cc (built for the baseline of the architecture) cuts the work into blocks, runs
// them on threads, and calls the path that this CPU supports. Every path gives the same bits: each
// keeps the same eight float64 accumulators per block, adds them in the same order, and rounds once on
// output, without FMA contraction (-ffp-contract=off).
//
// A path's object defines no weak symbol: an inline function compiled with AVX-512 in it, merged by the
// linker with the baseline's copy, could be the one every path calls. setup.py checks this with nm.
#ifndef TF_ADASUM_KERNELS_ADASUM_CPU_PATH_H_
#define TF_ADASUM_KERNELS_ADASUM_CPU_PATH_H_

#include <cstdint>

namespace adasum {

// The loops of one path, per dtype code of adasum_dtypes.h (float16, bfloat16, float32, float64).
// Pointers are to elements of that dtype.
struct CpuPath {
  const char* name;
  // result[0..2] = (a.b, |a|^2, |b|^2) over n elements, in float64.
  void (*dot_norms[4])(const void* a, const void* b, int64_t n, double* result);
  // out = ca a + cb b in float64, rounded once. `stream`: the output may bypass the caches.
  void (*combine64[4])(const void* a, const void* b, double ca, double cb, void* out, int64_t n, bool stream);
  // out = ca a + cb b in float32, rounded once: float16 and bfloat16 only (entries 0 and 1).
  void (*combine32[2])(const void* a, const void* b, float ca, float cb, void* out, int64_t n);
};

namespace cpu_paths {
#if defined(ADASUM_CPU_PATH_CUSTOM)
// TF_ADASUM_ARCH_FLAGS set: one path, built with those flags (as is all the rest), in place of the others.
extern const CpuPath custom;
#else
// Plain C++ that the compiler may vectorise for the architecture's baseline (x86-64: SSE2).
extern const CpuPath portable;
#if defined(__x86_64__)
extern const CpuPath avx2;        // AVX2, FMA (never contracted), F16C
extern const CpuPath avx512;      // AVX-512 F, BW, VL, DQ: 16-lane float16/bfloat16 conversions
extern const CpuPath avx512bf16;  // and AVX512_BF16's float32 -> bfloat16 conversion
#endif
#endif
}  // namespace cpu_paths

}  // namespace adasum

#endif  // TF_ADASUM_KERNELS_ADASUM_CPU_PATH_H_
