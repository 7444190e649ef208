// C entry points to the CPU core for callers without TensorFlow tensors: the MPI engine runs the whole
// vector-halving, distance-doubling algorithm over one numpy buffer per dtype (tf_adasum/vhdd.py) and
// calls these through ctypes, with no TensorFlow op between its exchanges.
//
// They compute exactly what the SegmentDotNorms and SegmentCombine ops compute: the same core, the same
// blocks, partial sums added in block order, so the results do not depend on the thread count.

#include <cmath>
#include <cstdint>
#include <functional>
#include <thread>
#include <type_traits>
#include <vector>

#include "adasum_core.h"
#include "adasum_dtypes.h"

namespace {

// Runs fn over [0, units) in `threads` contiguous chunks, on this thread and threads - 1 others.
adasum::ParallelFor ThreadsFor(int threads) {
  if (threads <= 1) return nullptr;
  return [threads](int64_t units, int64_t, const std::function<void(int64_t, int64_t)>& fn) {
    const int64_t chunks = units < threads ? units : threads;
    std::vector<std::thread> others;
    for (int64_t c = 1; c < chunks; ++c) {
      others.emplace_back(fn, units * c / chunks, units * (c + 1) / chunks);
    }
    fn(0, units / chunks);
    for (std::thread& t : others) t.join();
  };
}

template <typename T>
void Pieces(const void* a, const void* b, const int64_t* bounds, int pieces, std::vector<const T*>* pa,
            std::vector<const T*>* pb, std::vector<int64_t>* sizes) {
  for (int i = 0; i < pieces; ++i) {
    pa->push_back(static_cast<const T*>(a) + bounds[i]);
    pb->push_back(static_cast<const T*>(b) + bounds[i]);
    sizes->push_back(bounds[i + 1] - bounds[i]);
  }
}

template <typename T>
void DotNorms(const void* a, const void* b, const int64_t* bounds, int pieces, double* dot_norms, int threads) {
  std::vector<const T*> pa, pb;
  std::vector<int64_t> sizes;
  Pieces<T>(a, b, bounds, pieces, &pa, &pb, &sizes);
  adasum::DotNormsCpu<T>(pieces, pa.data(), pb.data(), sizes.data(), dot_norms, ThreadsFor(threads));
}

template <typename T>
void Combine(const void* a, const void* b, const double* dot_norms, void* out, const int64_t* bounds, int pieces,
             int threads) {
  std::vector<const T*> pa, pb;
  std::vector<int64_t> sizes;
  Pieces<T>(a, b, bounds, pieces, &pa, &pb, &sizes);
  std::vector<T*> po;
  for (int i = 0; i < pieces; ++i) po.push_back(static_cast<T*>(out) + bounds[i]);
  adasum::CombineCpu<T>(pieces, pa.data(), pb.data(), dot_norms, po.data(), sizes.data(), ThreadsFor(threads));
}

template <typename T>
void CopyNorms(int n, const void* const* src, const int64_t* sizes, void* dst, const int64_t* starts, double* norms,
               int threads) {
  std::vector<const T*> ps;
  std::vector<T*> pd;
  for (int i = 0; i < n; ++i) {
    ps.push_back(static_cast<const T*>(src[i]));
    pd.push_back(static_cast<T*>(dst) + starts[i]);
  }
  adasum::CopyNormsCpu<T>(n, ps.data(), sizes, pd.data(), norms, ThreadsFor(threads));
}

// Calls f with a null pointer of the storage type that `dtype` names; -1 for an unknown dtype.
template <typename F>
int ByDtype(int dtype, F&& f) {
  switch (dtype) {
    case ADASUM_FLOAT16: f(static_cast<adasum::Half*>(nullptr)); return 0;
    case ADASUM_BFLOAT16: f(static_cast<adasum::BFloat16*>(nullptr)); return 0;
    case ADASUM_FLOAT32: f(static_cast<float*>(nullptr)); return 0;
    case ADASUM_FLOAT64: f(static_cast<double*>(nullptr)); return 0;
    default: return -1;
  }
}

}  // namespace

extern "C" {

// Copies tensor i (sizes[i] elements at src[i]) to dst + starts[i], and sets norms[i] = |tensor i|^2 in
// float64, bit for bit what tf_adasum_segment_dot_norms gives for it. Returns 0, or -1 for an unknown
// dtype.
int tf_adasum_copy_norms(int dtype, int n, const void* const* src, const int64_t* sizes, void* dst,
                         const int64_t* starts, double* norms, int threads) {
  return ByDtype(dtype, [&](auto* type) {
    CopyNorms<std::remove_pointer_t<decltype(type)>>(n, src, sizes, dst, starts, norms, threads);
  });
}

// dot_norms[3 i + {0, 1, 2}] = (a.b, |a|^2, |b|^2) over the piece [bounds[i], bounds[i + 1]) of the
// 1-D buffers a and b, in float64. Returns 0, or -1 for an unknown dtype.
int tf_adasum_segment_dot_norms(int dtype, const void* a, const void* b, const int64_t* bounds, int pieces,
                                double* dot_norms, int threads) {
  return ByDtype(dtype, [&](auto* type) {
    DotNorms<std::remove_pointer_t<decltype(type)>>(a, b, bounds, pieces, dot_norms, threads);
  });
}

// out = adasum(a, b) piece by piece, with each piece's coefficients from its row of dot_norms. out may
// be a or b. Returns 0; i + 1 when row i of dot_norms is not finite (nothing is written then); -1 for
// an unknown dtype.
int tf_adasum_segment_combine(int dtype, const void* a, const void* b, const double* dot_norms, void* out,
                              const int64_t* bounds, int pieces, int threads) {
  for (int i = 0; i < 3 * pieces; ++i) {
    if (!std::isfinite(dot_norms[i])) return i / 3 + 1;
  }
  return ByDtype(dtype, [&](auto* type) {
    Combine<std::remove_pointer_t<decltype(type)>>(a, b, dot_norms, out, bounds, pieces, threads);
  });
}

}  // extern "C"
