// TensorFlow adapter, the ops: registers Adasum>DotNorms, Adasum>Combine and their segment forms, with
// shape functions that check and name what they refuse. Their kernels are in adasum_kernels.cc.
#include <vector>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

// The loader reads this marker out of the file, without loading it, to refuse a library built for
// another TensorFlow with a message instead of a crash.
#ifndef TF_ADASUM_BUILT_FOR_TF
#error "build with -DTF_ADASUM_BUILT_FOR_TF=\"<tf.__version__>\" (setup.py does this)"
#endif
#if GOOGLE_CUDA
#define TF_ADASUM_GPU_KERNELS "1"
#else
#define TF_ADASUM_GPU_KERNELS "0"
#endif
extern "C" __attribute__((used, visibility("default"))) const char tf_adasum_build_marker[] =
    "TF_ADASUM_BUILT_FOR_TF=" TF_ADASUM_BUILT_FOR_TF ";TF_ADASUM_GPU_KERNELS=" TF_ADASUM_GPU_KERNELS ";";

namespace tensorflow {
namespace {

using shape_inference::DimensionHandle;
using shape_inference::InferenceContext;
using shape_inference::ShapeHandle;

// Merges a_i with b_i for every i, naming the tensor whose shapes disagree.
absl::Status MergePairShapes(InferenceContext* c, const char* op, int n, std::vector<ShapeHandle>* merged) {
  merged->resize(n);
  for (int i = 0; i < n; ++i) {
    if (!c->Merge(c->input(i), c->input(n + i), &(*merged)[i]).ok()) {
      return errors::InvalidArgument(op, ": tensor ", i, " of ", n, " has shape ", c->DebugString(c->input(i)),
                                     " in a but ", c->DebugString(c->input(n + i)), " in b");
    }
  }
  return absl::OkStatus();
}

REGISTER_OP("Adasum>DotNorms")
    .Input("a: N * T")
    .Input("b: N * T")
    .Output("dot_norms: double")
    .Attr("T: {half, bfloat16, float, double}")
    .Attr("N: int >= 1")
    .SetShapeFn([](InferenceContext* c) {
      int n;
      TF_RETURN_IF_ERROR(c->GetAttr("N", &n));
      std::vector<ShapeHandle> merged;
      TF_RETURN_IF_ERROR(MergePairShapes(c, "Adasum>DotNorms", n, &merged));
      c->set_output(0, c->Matrix(n, 3));
      return absl::OkStatus();
    })
    .Doc(R"doc(
Per-tensor (a_i . b_i, |a_i|^2, |b_i|^2), accumulated in float64, in one pass over memory.

a: N tensors.
b: N tensors, b_i with the shape of a_i.
dot_norms: float64 [N, 3].
)doc");

REGISTER_OP("Adasum>Combine")
    .Input("a: N * T")
    .Input("b: N * T")
    .Input("dot_norms: double")
    .Output("out: N * T")
    .Attr("T: {half, bfloat16, float, double}")
    .Attr("N: int >= 1")
    .SetShapeFn([](InferenceContext* c) {
      int n;
      TF_RETURN_IF_ERROR(c->GetAttr("N", &n));
      std::vector<ShapeHandle> merged;
      TF_RETURN_IF_ERROR(MergePairShapes(c, "Adasum>Combine", n, &merged));
      ShapeHandle dot_norms;
      DimensionHandle unused;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(2 * n), 2, &dot_norms));
      TF_RETURN_IF_ERROR(c->WithValue(c->Dim(dot_norms, 0), n, &unused));
      TF_RETURN_IF_ERROR(c->WithValue(c->Dim(dot_norms, 1), 3, &unused));
      for (int i = 0; i < n; ++i) c->set_output(i, merged[i]);
      return absl::OkStatus();
    })
    .Doc(R"doc(
out_i = (1 - d_i / (2 |a_i|^2)) a_i + (1 - d_i / (2 |b_i|^2)) b_i with (d_i, |a_i|^2, |b_i|^2) taken from
dot_norms; a coefficient is 1 where its squared norm is below sqrt(DBL_MIN).

a: N tensors.
b: N tensors, b_i with the shape of a_i.
dot_norms: float64 [N, 3], as made by Adasum>DotNorms.
out: N tensors; out_i may reuse the buffer of a_i.
)doc");

// The segment ops take one fused buffer per side and the piece boundaries inside it, so the
// distributed algorithm needs no split or concat per level. bounds = [0, ..., len(a)], nondecreasing.
absl::Status SegmentShapes(InferenceContext* c, const char* op, ShapeHandle* buffer, DimensionHandle* pieces) {
  ShapeHandle a, b, bounds;
  TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 1, &a));
  TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 1, &b));
  if (!c->Merge(a, b, buffer).ok()) {
    return errors::InvalidArgument(op, ": a has shape ", c->DebugString(a), " but b has ", c->DebugString(b));
  }
  TF_RETURN_IF_ERROR(c->WithRank(c->input(c->num_inputs() - 1), 1, &bounds));
  return c->Subtract(c->Dim(bounds, 0), 1, pieces);
}

REGISTER_OP("Adasum>SegmentDotNorms")
    .Input("a: T")
    .Input("b: T")
    .Input("bounds: int64")
    .Output("dot_norms: double")
    .Attr("T: {half, bfloat16, float, double}")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle buffer;
      DimensionHandle pieces;
      TF_RETURN_IF_ERROR(SegmentShapes(c, "Adasum>SegmentDotNorms", &buffer, &pieces));
      c->set_output(0, c->Matrix(pieces, 3));
      return absl::OkStatus();
    })
    .Doc("Adasum>DotNorms over the pieces [bounds[i], bounds[i+1]) of two 1-D buffers.");

REGISTER_OP("Adasum>SegmentCombine")
    .Input("a: T")
    .Input("b: T")
    .Input("dot_norms: double")
    .Input("bounds: int64")
    .Output("out: T")
    .Attr("T: {half, bfloat16, float, double}")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle buffer, dot_norms;
      DimensionHandle pieces, unused;
      TF_RETURN_IF_ERROR(SegmentShapes(c, "Adasum>SegmentCombine", &buffer, &pieces));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(2), 2, &dot_norms));
      TF_RETURN_IF_ERROR(c->Merge(c->Dim(dot_norms, 0), pieces, &unused));
      TF_RETURN_IF_ERROR(c->WithValue(c->Dim(dot_norms, 1), 3, &unused));
      c->set_output(0, buffer);
      return absl::OkStatus();
    })
    .Doc("Adasum>Combine over the pieces [bounds[i], bounds[i+1]) of two 1-D buffers; may reuse a's buffer.");

}  // namespace
}  // namespace tensorflow
