// The TensorFlow-free CPU core as a program, for tests/test_build.py: it runs where this Python cannot
// load the library (an aarch64 build under qemu-user) and with flush-to-zero set as TensorFlow sets it.
//
// stdin:  int32 dtype code, int32 pieces, int64 n, int32 crafted; int64 bounds[pieces + 1]; a[n], b[n]
//         (elements of the dtype); double rows[crafted][pieces][3]
// stdout: double dot_norms[pieces][3]; then out[n] combined with those rows (when they are finite);
//         then out[n] per crafted set of rows
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#if defined(__SSE__)
#include <immintrin.h>
#endif

extern "C" {
int tf_adasum_segment_dot_norms(int dtype, const void* a, const void* b, const int64_t* bounds, int pieces,
                                double* dot_norms, int threads);
int tf_adasum_segment_combine(int dtype, const void* a, const void* b, const double* dot_norms, void* out,
                              const int64_t* bounds, int pieces, int threads);
}

namespace {

template <typename T>
void Read(T* data, size_t count) {
  if (std::fread(data, sizeof(T), count, stdin) != count) {
    std::fprintf(stderr, "core_driver: short input\n");
    std::exit(2);
  }
}

template <typename T>
void Write(const T* data, size_t count) {
  std::fwrite(data, sizeof(T), count, stdout);
}

// What TensorFlow does around every kernel: subnormals flushed to zero, unless the core undoes it.
void FlushToZero() {
#if defined(__SSE__)
  _mm_setcsr(_mm_getcsr() | 0x8040);  // FTZ and DAZ
#elif defined(__aarch64__)
  uint64_t fpcr;
  __asm__ volatile("mrs %0, fpcr" : "=r"(fpcr));
  fpcr |= uint64_t{1} << 24;  // FZ
  __asm__ volatile("msr fpcr, %0" : : "r"(fpcr));
#endif
}

}  // namespace

int main() {
  int32_t dtype, pieces, crafted;
  int64_t n;
  Read(&dtype, 1);
  Read(&pieces, 1);
  Read(&n, 1);
  Read(&crafted, 1);
  const size_t width = dtype == 3 ? 8 : dtype == 2 ? 4 : 2;
  std::vector<int64_t> bounds(pieces + 1);
  Read(bounds.data(), bounds.size());
  std::vector<unsigned char> a(n * width), b(n * width), out(n * width);
  Read(a.data(), a.size());
  Read(b.data(), b.size());
  std::vector<double> rows(static_cast<size_t>(crafted) * pieces * 3);
  Read(rows.data(), rows.size());

  FlushToZero();
  std::vector<double> dot_norms(pieces * 3);
  if (tf_adasum_segment_dot_norms(dtype, a.data(), b.data(), bounds.data(), pieces, dot_norms.data(), 2) != 0) {
    return 3;
  }
  Write(dot_norms.data(), dot_norms.size());
  if (tf_adasum_segment_combine(dtype, a.data(), b.data(), dot_norms.data(), out.data(), bounds.data(), pieces,
                                2) == 0) {
    Write(out.data(), out.size());
  }
  for (int32_t k = 0; k < crafted; ++k) {
    if (tf_adasum_segment_combine(dtype, a.data(), b.data(), rows.data() + k * pieces * 3, out.data(),
                                  bounds.data(), pieces, 2) != 0) {
      return 4;
    }
    Write(out.data(), out.size());
  }
  return 0;
}
