// TensorFlow adapter, the kernels: the ops of adasum_ops.cc on CPU and, under GOOGLE_CUDA, on GPU, each
// handing the work to the TensorFlow-free cores (adasum_cpu.cc, adasum_cuda.cu).
#define EIGEN_USE_THREADS
#if GOOGLE_CUDA
// Before any TensorFlow header: Eigen declares its GPU device only if this is set when it is first seen.
#define EIGEN_USE_GPU
#endif

#include <cmath>
#include <string>
#include <vector>

#include "adasum_core.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"

#if GOOGLE_CUDA
#include "adasum_cuda.h"
#endif

namespace tensorflow {
namespace {

using CPUDevice = Eigen::ThreadPoolDevice;

// TensorFlow's element types and the cores' bit-compatible storage types.
template <typename T>
struct Storage {
  using type = T;
};
template <>
struct Storage<Eigen::half> {
  using type = adasum::Half;
};
template <>
struct Storage<Eigen::bfloat16> {
  using type = adasum::BFloat16;
};

// The raw pointers and sizes of both input lists, after checking that shapes pair up.
template <typename T>
struct PairedInputs {
  using S = typename Storage<T>::type;
  std::vector<const S*> a, b;
  std::vector<int64_t> sizes;
};

template <typename T>
absl::Status GetPairedInputs(OpKernelContext* ctx, const char* op, PairedInputs<T>* in) {
  using S = typename PairedInputs<T>::S;
  OpInputList a, b;
  TF_RETURN_IF_ERROR(ctx->input_list("a", &a));
  TF_RETURN_IF_ERROR(ctx->input_list("b", &b));
  const int n = a.size();
  for (int i = 0; i < n; ++i) {
    if (a[i].shape() != b[i].shape()) {
      return errors::InvalidArgument(op, ": tensor ", i, " of ", n, " has shape ", a[i].shape().DebugString(),
                                     " in a but ", b[i].shape().DebugString(), " in b");
    }
    in->a.push_back(reinterpret_cast<const S*>(a[i].flat<T>().data()));
    in->b.push_back(reinterpret_cast<const S*>(b[i].flat<T>().data()));
    in->sizes.push_back(a[i].NumElements());
  }
  return absl::OkStatus();
}

// The pieces of two equal-length 1-D buffers as pointer lists, after checking the bounds.
template <typename T>
absl::Status GetSegmentInputs(OpKernelContext* ctx, const char* op, PairedInputs<T>* in) {
  using S = typename PairedInputs<T>::S;
  const Tensor& a = ctx->input(0);
  const Tensor& b = ctx->input(1);
  const Tensor& bounds = ctx->input(ctx->num_inputs() - 1);
  if (a.dims() != 1 || a.shape() != b.shape()) {
    return errors::InvalidArgument(op, ": a and b must be 1-D of one length, got ", a.shape().DebugString(),
                                   " and ", b.shape().DebugString());
  }
  const auto edge = bounds.flat<int64_t>();
  const int64_t n = a.NumElements();
  if (bounds.dims() != 1 || edge.size() < 1 || edge(0) != 0 || edge(edge.size() - 1) != n) {
    return errors::InvalidArgument(op, ": bounds must run from 0 to ", n, ", got ", bounds.DebugString());
  }
  const S* a_base = reinterpret_cast<const S*>(a.flat<T>().data());
  const S* b_base = reinterpret_cast<const S*>(b.flat<T>().data());
  for (int64_t i = 0; i + 1 < edge.size(); ++i) {
    if (edge(i + 1) < edge(i)) {
      return errors::InvalidArgument(op, ": bounds must not decrease, got ", edge(i), " then ", edge(i + 1));
    }
    in->a.push_back(a_base + edge(i));
    in->b.push_back(b_base + edge(i));
    in->sizes.push_back(edge(i + 1) - edge(i));
  }
  return absl::OkStatus();
}

adasum::ParallelFor CpuParallelFor(OpKernelContext* ctx) {
  auto* workers = ctx->device()->tensorflow_cpu_worker_threads()->workers;
  return [workers](int64_t units, int64_t cost, const std::function<void(int64_t, int64_t)>& fn) {
    workers->ParallelFor(units, cost, fn);
  };
}

template <typename Device, typename T>
struct DotNormsFunctor;

template <typename Device, typename T>
struct CombineFunctor;

template <typename T>
struct DotNormsFunctor<CPUDevice, T> {
  void operator()(OpKernelContext* ctx, const PairedInputs<T>& in, double* dot_norms) {
    adasum::DotNormsCpu(static_cast<int>(in.sizes.size()), in.a.data(), in.b.data(), in.sizes.data(), dot_norms,
                        CpuParallelFor(ctx));
  }
};

template <typename T>
struct CombineFunctor<CPUDevice, T> {
  using S = typename Storage<T>::type;
  void operator()(OpKernelContext* ctx, const PairedInputs<T>& in, const double* dot_norms,
                  const std::vector<S*>& out) {
    adasum::CombineCpu(static_cast<int>(in.sizes.size()), in.a.data(), in.b.data(), dot_norms, out.data(),
                       in.sizes.data(), CpuParallelFor(ctx));
  }
};

// Checks a [pieces, 3] dot_norms tensor, which lives in host memory on every device (HostMemory on
// GPU), and refuses non-finite rows with the index of the tensor.
absl::Status CheckDotNorms(const char* op, const Tensor& dot_norms, int n) {
  if (dot_norms.shape() != TensorShape({n, 3})) {
    return errors::InvalidArgument(op, ": dot_norms must have shape [", n, ", 3] for ", n, " tensors, got ",
                                   dot_norms.shape().DebugString());
  }
  const double* dn = dot_norms.flat<double>().data();
  for (int i = 0; i < 3 * n; ++i) {
    if (!std::isfinite(dn[i])) {
      const int t = i / 3;
      return errors::InvalidArgument(op, ": tensor ", t, " of ", n, " has a non-finite (a.b, |a|^2, |b|^2) = (",
                                     dn[3 * t], ", ", dn[3 * t + 1], ", ", dn[3 * t + 2],
                                     "): a or b holds NaN or Inf, or a squared norm overflows float64");
    }
  }
  return absl::OkStatus();
}

// kSegments: the inputs are one 1-D buffer per side plus bounds, instead of lists of tensors.
template <typename Device, typename T, bool kSegments>
class DotNormsOp : public OpKernel {
 public:
  explicit DotNormsOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const char* op = kSegments ? "Adasum>SegmentDotNorms" : "Adasum>DotNorms";
    PairedInputs<T> in;
    OP_REQUIRES_OK(ctx, kSegments ? GetSegmentInputs(ctx, op, &in) : GetPairedInputs(ctx, op, &in));
    Tensor* dot_norms = nullptr;
    const int64_t n = static_cast<int64_t>(in.sizes.size());
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({n, 3}), &dot_norms));
    DotNormsFunctor<Device, T>()(ctx, in, dot_norms->flat<double>().data());
  }
};

template <typename Device, typename T, bool kSegments>
class CombineOp : public OpKernel {
 public:
  explicit CombineOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    using S = typename Storage<T>::type;
    const char* op = kSegments ? "Adasum>SegmentCombine" : "Adasum>Combine";
    PairedInputs<T> in;
    OP_REQUIRES_OK(ctx, kSegments ? GetSegmentInputs(ctx, op, &in) : GetPairedInputs(ctx, op, &in));
    const int n = static_cast<int>(in.sizes.size());
    const Tensor& dot_norms = ctx->input(kSegments ? 2 : 2 * n);
    OP_REQUIRES_OK(ctx, CheckDotNorms(op, dot_norms, n));
    std::vector<S*> out(n);
    if (kSegments) {
      Tensor* t = nullptr;
      OP_REQUIRES_OK(ctx, ctx->forward_input_or_allocate_output({0, 1}, 0, ctx->input(0).shape(), &t));
      S* base = reinterpret_cast<S*>(t->flat<T>().data());
      for (int i = 0; i < n; ++i) out[i] = base + (in.a[i] - reinterpret_cast<const S*>(ctx->input(0).flat<T>().data()));
    } else {
      for (int i = 0; i < n; ++i) {
        Tensor* t = nullptr;
        // Input i is a_i and input n + i is b_i; either buffer can hold out_i if nothing else needs it.
        OP_REQUIRES_OK(ctx, ctx->forward_input_or_allocate_output({i, n + i}, i, ctx->input(i).shape(), &t));
        out[i] = reinterpret_cast<S*>(t->flat<T>().data());
      }
    }
    CombineFunctor<Device, T>()(ctx, in, dot_norms.flat<double>().data(), out);
  }
};

#define REGISTER_CPU(T)                                                                                   \
  REGISTER_KERNEL_BUILDER(Name("Adasum>DotNorms").Device(DEVICE_CPU).TypeConstraint<T>("T"),            \
                          DotNormsOp<CPUDevice, T, false>);                                               \
  REGISTER_KERNEL_BUILDER(Name("Adasum>Combine").Device(DEVICE_CPU).TypeConstraint<T>("T"),             \
                          CombineOp<CPUDevice, T, false>);                                                \
  REGISTER_KERNEL_BUILDER(Name("Adasum>SegmentDotNorms").Device(DEVICE_CPU).TypeConstraint<T>("T"),     \
                          DotNormsOp<CPUDevice, T, true>);                                                \
  REGISTER_KERNEL_BUILDER(Name("Adasum>SegmentCombine").Device(DEVICE_CPU).TypeConstraint<T>("T"),      \
                          CombineOp<CPUDevice, T, true>);
REGISTER_CPU(Eigen::half)
REGISTER_CPU(Eigen::bfloat16)
REGISTER_CPU(float)
REGISTER_CPU(double)
#undef REGISTER_CPU

#if GOOGLE_CUDA
using GPUDevice = Eigen::GpuDevice;

template <typename T>
constexpr int CudaDtype();
template <>
constexpr int CudaDtype<Eigen::half>() {
  return ADASUM_FLOAT16;
}
template <>
constexpr int CudaDtype<Eigen::bfloat16>() {
  return ADASUM_BFLOAT16;
}
template <>
constexpr int CudaDtype<float>() {
  return ADASUM_FLOAT32;
}
template <>
constexpr int CudaDtype<double>() {
  return ADASUM_FLOAT64;
}

// Device scratch for the launchers: the tensor table and per-block partial sums.
void* AllocateCudaWorkspace(OpKernelContext* ctx, const std::vector<int64_t>& sizes, Tensor* holder) {
  const int64_t bytes =
      static_cast<int64_t>(adasum_cuda_workspace_bytes(static_cast<int>(sizes.size()), sizes.data()));
  if (!ctx->allocate_temp(DT_INT8, TensorShape({bytes}), holder).ok()) return nullptr;
  return holder->flat<int8>().data();
}

template <typename T>
struct DotNormsFunctor<GPUDevice, T> {
  void operator()(OpKernelContext* ctx, const PairedInputs<T>& in, double* dot_norms) {
    Tensor workspace;
    void* scratch = AllocateCudaWorkspace(ctx, in.sizes, &workspace);
    OP_REQUIRES(ctx, scratch != nullptr, errors::ResourceExhausted("Adasum>DotNorms: no GPU workspace"));
    const int err = adasum_cuda_dot_norms(
        CudaDtype<T>(), static_cast<int>(in.sizes.size()), reinterpret_cast<const void* const*>(in.a.data()),
        reinterpret_cast<const void* const*>(in.b.data()), in.sizes.data(), dot_norms, scratch,
        ctx->eigen_device<GPUDevice>().stream());
    OP_REQUIRES(ctx, err == 0, errors::Internal("Adasum>DotNorms: ", adasum_cuda_error_string(err)));
  }
};

template <typename T>
struct CombineFunctor<GPUDevice, T> {
  using S = typename Storage<T>::type;
  void operator()(OpKernelContext* ctx, const PairedInputs<T>& in, const double* dot_norms,
                  const std::vector<S*>& out) {
    Tensor workspace;
    void* scratch = AllocateCudaWorkspace(ctx, in.sizes, &workspace);
    OP_REQUIRES(ctx, scratch != nullptr, errors::ResourceExhausted("Adasum>Combine: no GPU workspace"));
    const int err = adasum_cuda_combine(
        CudaDtype<T>(), static_cast<int>(in.sizes.size()), reinterpret_cast<const void* const*>(in.a.data()),
        reinterpret_cast<const void* const*>(in.b.data()), dot_norms,
        reinterpret_cast<void* const*>(out.data()), in.sizes.data(), scratch,
        ctx->eigen_device<GPUDevice>().stream());
    OP_REQUIRES(ctx, err == 0, errors::Internal("Adasum>Combine: ", adasum_cuda_error_string(err)));
  }
};

#define REGISTER_GPU(T)                                                                                   \
  REGISTER_KERNEL_BUILDER(Name("Adasum>DotNorms").Device(DEVICE_GPU).TypeConstraint<T>("T"),            \
                          DotNormsOp<GPUDevice, T, false>);                                               \
  REGISTER_KERNEL_BUILDER(                                                                                \
      Name("Adasum>Combine").Device(DEVICE_GPU).TypeConstraint<T>("T").HostMemory("dot_norms"),           \
      CombineOp<GPUDevice, T, false>);                                                                    \
  REGISTER_KERNEL_BUILDER(                                                                                \
      Name("Adasum>SegmentDotNorms").Device(DEVICE_GPU).TypeConstraint<T>("T").HostMemory("bounds"),      \
      DotNormsOp<GPUDevice, T, true>);                                                                    \
  REGISTER_KERNEL_BUILDER(Name("Adasum>SegmentCombine")                                                   \
                              .Device(DEVICE_GPU)                                                         \
                              .TypeConstraint<T>("T")                                                     \
                              .HostMemory("dot_norms")                                                    \
                              .HostMemory("bounds"),                                                      \
                          CombineOp<GPUDevice, T, true>);
REGISTER_GPU(Eigen::half)
REGISTER_GPU(Eigen::bfloat16)
REGISTER_GPU(float)
REGISTER_GPU(double)
#undef REGISTER_GPU
#endif  // GOOGLE_CUDA

}  // namespace
}  // namespace tensorflow
