// C interface of the CUDA Adasum kernels (adasum_cuda.cu). No TensorFlow and no CUDA header is
// needed to call it: streams are passed as void*, so the TensorFlow adapter, a ctypes harness and
// other frameworks all use the same launchers.
#ifndef TF_ADASUM_KERNELS_ADASUM_CUDA_H_
#define TF_ADASUM_KERNELS_ADASUM_CUDA_H_

#include <stddef.h>
#include <stdint.h>

#include "adasum_dtypes.h"

#ifdef __cplusplus
extern "C" {
#endif

// Bytes of device scratch the launchers need for n tensors of these sizes.
size_t adasum_cuda_workspace_bytes(int n, const int64_t* sizes);

// dot_norms (device, float64 [n, 3]) = per tensor (a_i.b_i, |a_i|^2, |b_i|^2), accumulated in float64.
// a and b are host arrays of n device pointers; sizes is a host array. Returns a cudaError_t (0: ok).
// dtype is an ADASUM_* code (adasum_dtypes.h).
int adasum_cuda_dot_norms(int dtype, int n, const void* const* a, const void* const* b, const int64_t* sizes,
                          double* dot_norms, void* workspace, void* stream);

// out_i = ca_i a_i + cb_i b_i. dot_norms is a HOST float64 [n, 3] array: the coefficients and the
// zero guard are computed on the host and travel with the tensor table. out_i may alias a_i or b_i.
int adasum_cuda_combine(int dtype, int n, const void* const* a, const void* const* b, const double* dot_norms,
                        void* const* out, const int64_t* sizes, void* workspace, void* stream);

const char* adasum_cuda_error_string(int error);

#ifdef __cplusplus
}
#endif

#endif  // TF_ADASUM_KERNELS_ADASUM_CUDA_H_
