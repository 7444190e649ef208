/* The dtype codes of tf_adasum's C entry points, in one place: the CUDA launchers (adasum_cuda.h), the
 * host entry points (adasum_c_api.cc, which tf_adasum/ops.py calls through ctypes) and the TensorFlow
 * adapter's GPU kernels all take these. Plain C with no other header, so nvcc, g++ and any C caller can
 * include it. Python mirrors them in tf_adasum/ops.py (tests/test_ops.py checks the two agree), and
 * tests/gpu/test_cuda.py reads them from this file. */
#ifndef TF_ADASUM_KERNELS_ADASUM_DTYPES_H_
#define TF_ADASUM_KERNELS_ADASUM_DTYPES_H_

enum {
  ADASUM_FLOAT16 = 0,
  ADASUM_BFLOAT16 = 1,
  ADASUM_FLOAT32 = 2,
  ADASUM_FLOAT64 = 3,
};

#endif /* TF_ADASUM_KERNELS_ADASUM_DTYPES_H_ */
