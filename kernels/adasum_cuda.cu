// CUDA kernels for Adasum>DotNorms and Adasum>Combine. No TensorFlow header: built with plain nvcc.
//
// A whole list of tensors is one launch. Every tensor is cut into chunks of kChunkElements; one
// thread block handles one chunk and finds its tensor by binary search in the tensor table. Partial
// sums per chunk are written to scratch and added per tensor in chunk order by a second kernel, so
// the result is bitwise reproducible (no float atomics).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <vector>

#include "adasum_core.h"
#include "adasum_cuda.h"

namespace adasum {
namespace {

constexpr int kThreads = 256;
// 64 elements per thread: enough loads in flight per thread to hide DRAM latency, and chunk counts
// in the thousands for model-sized tensors, which fill every SM.
constexpr int64_t kChunkElements = 64 * kThreads;

struct TensorEntry {
  const void* a;
  const void* b;
  void* out;
  int64_t size;
  int64_t first_chunk;
  double ca;
  double cb;
};

template <typename T>
struct Element;
// Conversions to and from float64, the type float32 and float64 are combined in, and the half types
// when a coefficient exceeds kFloat32CombineLimit.
template <>
struct Element<double> {
  static constexpr bool kHalf = false;
  __device__ static double Load(double x) { return x; }
  __device__ static double Store(double x) { return x; }
};
template <>
struct Element<float> {
  static constexpr bool kHalf = false;
  __device__ static double Load(float x) { return x; }
  __device__ static float Store(double x) { return static_cast<float>(x); }
};
template <>
struct Element<__half> {
  static constexpr bool kHalf = true;
  __device__ static double Load(__half x) { return __half2float(x); }
  __device__ static __half Store(double x) { return __double2half(x); }
  __device__ static float LoadFloat(__half x) { return __half2float(x); }
  __device__ static __half StoreFloat(float x) { return __float2half_rn(x); }
};
template <>
struct Element<__nv_bfloat16> {
  static constexpr bool kHalf = true;
  __device__ static double Load(__nv_bfloat16 x) { return __bfloat162float(x); }
  __device__ static __nv_bfloat16 Store(double x) { return __double2bfloat16(x); }
  __device__ static float LoadFloat(__nv_bfloat16 x) { return __bfloat162float(x); }
  __device__ static __nv_bfloat16 StoreFloat(float x) { return __float2bfloat16_rn(x); }
};

int64_t ChunksOf(int64_t size) { return (size + kChunkElements - 1) / kChunkElements; }

// Index of the tensor that owns `chunk`: the last entry whose first_chunk <= chunk with a non-empty
// range (empty tensors own no chunk and share first_chunk with their successor).
__device__ int FindTensor(const TensorEntry* table, int n, int64_t chunk) {
  int lo = 0, hi = n - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (table[mid].first_chunk <= chunk) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

__device__ double WarpSum(double x) {
  for (int offset = 16; offset > 0; offset /= 2) x += __shfl_down_sync(0xffffffffu, x, offset);
  return x;
}

// Sums three doubles over the block; thread 0 gets the totals. The order is fixed by the thread
// layout, so it is the same on every run.
__device__ void BlockSum3(double* v) {
  __shared__ double warp_sums[3][kThreads / 32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int q = 0; q < 3; ++q) {
    v[q] = WarpSum(v[q]);
    if (lane == 0) warp_sums[q][warp] = v[q];
  }
  __syncthreads();
  if (warp == 0) {
    for (int q = 0; q < 3; ++q) {
      v[q] = WarpSum(lane < kThreads / 32 ? warp_sums[q][lane] : 0.0);
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    DotNormsChunkKernel(const TensorEntry* table, int n, double* partials) {
  __shared__ int tensor;
  if (threadIdx.x == 0) tensor = FindTensor(table, n, blockIdx.x);
  __syncthreads();
  const TensorEntry e = table[tensor];
  const int64_t begin = (static_cast<int64_t>(blockIdx.x) - e.first_chunk) * kChunkElements;
  const int64_t end = min(begin + kChunkElements, e.size);
  const T* a = static_cast<const T*>(e.a);
  const T* b = static_cast<const T*>(e.b);
  double v[3] = {0.0, 0.0, 0.0};
#pragma unroll 8
  for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) {
    const double x = Element<T>::Load(a[i]), y = Element<T>::Load(b[i]);
    v[0] = fma(x, y, v[0]);
    v[1] = fma(x, x, v[1]);
    v[2] = fma(y, y, v[2]);
  }
  BlockSum3(v);
  if (threadIdx.x == 0) {
    for (int q = 0; q < 3; ++q) partials[3 * static_cast<int64_t>(blockIdx.x) + q] = v[q];
  }
}

// One block per tensor: adds its chunks' partial sums in a fixed order.
__global__ void __launch_bounds__(kThreads)
    SumPartialsKernel(const TensorEntry* table, const double* partials, double* dot_norms) {
  const TensorEntry e = table[blockIdx.x];
  const int64_t chunks = (e.size + kChunkElements - 1) / kChunkElements;
  double v[3] = {0.0, 0.0, 0.0};
  for (int64_t c = threadIdx.x; c < chunks; c += kThreads) {
    for (int q = 0; q < 3; ++q) v[q] += partials[3 * (e.first_chunk + c) + q];
  }
  BlockSum3(v);
  if (threadIdx.x == 0) {
    for (int q = 0; q < 3; ++q) dot_norms[3 * static_cast<int64_t>(blockIdx.x) + q] = v[q];
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) CombineChunkKernel(const TensorEntry* table, int n) {
  __shared__ int tensor;
  if (threadIdx.x == 0) tensor = FindTensor(table, n, blockIdx.x);
  __syncthreads();
  const TensorEntry e = table[tensor];
  const int64_t begin = (static_cast<int64_t>(blockIdx.x) - e.first_chunk) * kChunkElements;
  const int64_t end = min(begin + kChunkElements, e.size);
  const T* a = static_cast<const T*>(e.a);
  const T* b = static_cast<const T*>(e.b);
  T* out = static_cast<T*>(e.out);
  // Explicit roundings keep nvcc from contracting into an FMA, which would break bitwise symmetry.
  // Both paths round exactly as the CPU core does: given the same dot_norms, CPU and GPU combine to the
  // same bits (tests/gpu/test_cuda.py). The dot products and norms are summed in another order than on
  // the CPU, so from the same inputs the two agree within float64 rounding of the coefficients.
  if constexpr (Element<T>::kHalf) {
    if (CombineInFloat32(e.ca, e.cb)) {
      const float ca = static_cast<float>(e.ca), cb = static_cast<float>(e.cb);
#pragma unroll 8
      for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) {
        out[i] = Element<T>::StoreFloat(
            __fadd_rn(__fmul_rn(ca, Element<T>::LoadFloat(a[i])), __fmul_rn(cb, Element<T>::LoadFloat(b[i]))));
      }
      return;
    }
  }
#pragma unroll 8
  for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) {
    out[i] = Element<T>::Store(
        __dadd_rn(__dmul_rn(e.ca, Element<T>::Load(a[i])), __dmul_rn(e.cb, Element<T>::Load(b[i]))));
  }
}

// Builds the tensor table on the host; returns the number of chunks.
int64_t BuildTable(int n, const void* const* a, const void* const* b, void* const* out, const double* dot_norms,
                   const int64_t* sizes, std::vector<TensorEntry>* table) {
  table->resize(n);
  int64_t chunks = 0;
  for (int i = 0; i < n; ++i) {
    TensorEntry& e = (*table)[i];
    e.a = a[i];
    e.b = b[i];
    e.out = out ? out[i] : nullptr;
    e.size = sizes[i];
    e.first_chunk = chunks;
    e.ca = e.cb = 1.0;
    if (dot_norms) AdasumCoefficients(dot_norms[3 * i], dot_norms[3 * i + 1], dot_norms[3 * i + 2], &e.ca, &e.cb);
    chunks += ChunksOf(sizes[i]);
  }
  return chunks;
}

size_t TableBytes(int n) { return (static_cast<size_t>(n) * sizeof(TensorEntry) + 255) / 256 * 256; }

template <typename T>
cudaError_t LaunchDotNorms(int n, const void* const* a, const void* const* b, const int64_t* sizes,
                           double* dot_norms, void* workspace, cudaStream_t stream) {
  std::vector<TensorEntry> table;
  const int64_t chunks = BuildTable(n, a, b, nullptr, nullptr, sizes, &table);
  auto* device_table = static_cast<TensorEntry*>(workspace);
  auto* partials = reinterpret_cast<double*>(static_cast<char*>(workspace) + TableBytes(n));
  // From pageable memory this returns once the table is staged, so `table` may go out of scope.
  cudaError_t err =
      cudaMemcpyAsync(device_table, table.data(), n * sizeof(TensorEntry), cudaMemcpyHostToDevice, stream);
  if (err != cudaSuccess) return err;
  if (chunks > 0) DotNormsChunkKernel<T><<<static_cast<unsigned>(chunks), kThreads, 0, stream>>>(device_table, n, partials);
  SumPartialsKernel<<<n, kThreads, 0, stream>>>(device_table, partials, dot_norms);
  return cudaGetLastError();
}

template <typename T>
cudaError_t LaunchCombine(int n, const void* const* a, const void* const* b, const double* dot_norms,
                          void* const* out, const int64_t* sizes, void* workspace, cudaStream_t stream) {
  std::vector<TensorEntry> table;
  const int64_t chunks = BuildTable(n, a, b, out, dot_norms, sizes, &table);
  if (chunks == 0) return cudaSuccess;
  auto* device_table = static_cast<TensorEntry*>(workspace);
  cudaError_t err =
      cudaMemcpyAsync(device_table, table.data(), n * sizeof(TensorEntry), cudaMemcpyHostToDevice, stream);
  if (err != cudaSuccess) return err;
  CombineChunkKernel<T><<<static_cast<unsigned>(chunks), kThreads, 0, stream>>>(device_table, n);
  return cudaGetLastError();
}

}  // namespace
}  // namespace adasum

extern "C" {

size_t adasum_cuda_workspace_bytes(int n, const int64_t* sizes) {
  int64_t chunks = 0;
  for (int i = 0; i < n; ++i) chunks += adasum::ChunksOf(sizes[i]);
  return adasum::TableBytes(n) + static_cast<size_t>(chunks) * 3 * sizeof(double);
}

int adasum_cuda_dot_norms(int dtype, int n, const void* const* a, const void* const* b, const int64_t* sizes,
                          double* dot_norms, void* workspace, void* stream) {
  if (n <= 0) return cudaSuccess;
  auto s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case ADASUM_FLOAT16:
      return adasum::LaunchDotNorms<__half>(n, a, b, sizes, dot_norms, workspace, s);
    case ADASUM_BFLOAT16:
      return adasum::LaunchDotNorms<__nv_bfloat16>(n, a, b, sizes, dot_norms, workspace, s);
    case ADASUM_FLOAT32:
      return adasum::LaunchDotNorms<float>(n, a, b, sizes, dot_norms, workspace, s);
    case ADASUM_FLOAT64:
      return adasum::LaunchDotNorms<double>(n, a, b, sizes, dot_norms, workspace, s);
  }
  return cudaErrorInvalidValue;
}

int adasum_cuda_combine(int dtype, int n, const void* const* a, const void* const* b, const double* dot_norms,
                        void* const* out, const int64_t* sizes, void* workspace, void* stream) {
  if (n <= 0) return cudaSuccess;
  auto s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case ADASUM_FLOAT16:
      return adasum::LaunchCombine<__half>(n, a, b, dot_norms, out, sizes, workspace, s);
    case ADASUM_BFLOAT16:
      return adasum::LaunchCombine<__nv_bfloat16>(n, a, b, dot_norms, out, sizes, workspace, s);
    case ADASUM_FLOAT32:
      return adasum::LaunchCombine<float>(n, a, b, dot_norms, out, sizes, workspace, s);
    case ADASUM_FLOAT64:
      return adasum::LaunchCombine<double>(n, a, b, dot_norms, out, sizes, workspace, s);
  }
  return cudaErrorInvalidValue;
}

const char* adasum_cuda_error_string(int error) { return cudaGetErrorString(static_cast<cudaError_t>(error)); }

}  // extern "C"
