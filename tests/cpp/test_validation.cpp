// Every entry point rejects bad arguments with a message that names the argument.
#include "test_util.h"

using namespace fbtest;

TEST(Validation, NormWeightOfWrongLength) {
  HostTensor x(DType::kFloat32, {2, 8}), w(DType::kFloat32, {7}), out(DType::kFloat32, {2, 8});
  expect_error([&] { fusebox::rms_norm(x.view, w.view, out.view, 1e-6f); }, {"weight", "8 elements", "[7]"});
}

TEST(Validation, NormDtypeMix) {
  HostTensor x(DType::kFloat16, {2, 8}), r(DType::kBFloat16, {2, 8}), out(DType::kFloat16, {2, 8}), h(DType::kFloat16, {2, 8});
  expect_error([&] { fusebox::fused_add_rms_norm(x.view, r.view, TensorView{}, out.view, h.view, 1e-6f); },
               {"residual", "float16", "bfloat16"});
}

TEST(Validation, RmsNormAddNamesResidual) {
  HostTensor x(DType::kBFloat16, {2, 8}), r(DType::kFloat16, {2, 8}), out(DType::kBFloat16, {2, 8});
  expect_error([&] { fusebox::rms_norm_add(x.view, r.view, TensorView{}, out.view, 1e-6f); },
               {"residual", "float16"});
  HostTensor wide(DType::kBFloat16, {2, 9});
  expect_error([&] { fusebox::rms_norm_add(x.view, wide.view, TensorView{}, out.view, 1e-6f); },
               {"residual", "[2, 9]"});
}

TEST(Validation, NonUnitLastStride) {
  HostTensor x(DType::kFloat32, {2, 8}, {16, 2}), out(DType::kFloat32, {2, 8});
  expect_error([&] { fusebox::rms_norm(x.view, TensorView{}, out.view, 1e-6f); }, {"x", "stride 2"});
}

TEST(Validation, ShapeMismatch) {
  HostTensor x(DType::kFloat32, {2, 8}), out(DType::kFloat32, {3, 8});
  expect_error([&] { fusebox::rms_norm(x.view, TensorView{}, out.view, 1e-6f); }, {"out", "[2, 8]", "[3, 8]"});
}

TEST(Validation, NegativeEps) {
  HostTensor x(DType::kFloat32, {2, 8}), out(DType::kFloat32, {2, 8});
  expect_error([&] { fusebox::rms_norm(x.view, TensorView{}, out.view, -1.f); }, {"eps"});
}

TEST(Validation, DeviceMix) {
  HostTensor x(DType::kFloat32, {2, 8}), w(DType::kFloat32, {8}), out(DType::kFloat32, {2, 8});
  TensorView wc = w.view;
  wc.device = fusebox::Device::kCUDA;
  expect_error([&] { fusebox::rms_norm(x.view, wc, out.view, 1e-6f); }, {"weight", "CUDA", "CPU"});
}

TEST(Validation, GateWithoutBranch) {
  HostTensor x(DType::kFloat32, {2, 8}), g(DType::kFloat32, {2, 8}), out(DType::kFloat32, {2, 8});
  fusebox::NormArgs a;
  a.x = x.view;
  a.gate = g.view;
  a.out = out.view;
  expect_error([&] { fusebox::norm(a); }, {"gate", "branch"});
}

TEST(Validation, SplitModulationNeedsEveryTable) {
  HostTensor x(DType::kBFloat16, {2, 8}), sc(DType::kBFloat16, {2, 8}), sh(DType::kBFloat16, {2, 8}),
      t(DType::kFloat32, {8}), out(DType::kBFloat16, {2, 8});
  fusebox::NormArgs a;
  a.x = x.view;
  a.scale = sc.view;
  a.shift = sh.view;
  a.scale_table = t.view;
  a.out = out.view;
  a.norm = fusebox::NormType::kLayer;
  expect_error([&] { fusebox::norm(a); }, {"shift", "shift_table"});
  a.shift_table = t.view;
  a.scale = TensorView{};
  expect_error([&] { fusebox::norm(a); }, {"scale_table", "needs scale"});
}

TEST(Validation, SplitModulationTermInXDtype) {
  HostTensor x(DType::kBFloat16, {2, 8}), g(DType::kFloat32, {2, 8}), b(DType::kBFloat16, {2, 8}),
      t(DType::kFloat32, {8}), h(DType::kBFloat16, {2, 8});
  fusebox::NormArgs a;
  a.x = x.view;
  a.branch = b.view;
  a.gate = g.view;
  a.gate_table = t.view;
  a.residual_out = h.view;
  a.norm = fusebox::NormType::kNone;
  expect_error([&] { fusebox::norm(a); }, {"gate", "bfloat16", "float32"});
}

TEST(Validation, RopeOddRotaryDim) {
  HostTensor q(DType::kFloat32, {1, 2, 1, 8}), qo(DType::kFloat32, {1, 2, 1, 8}), c(DType::kFloat32, {1, 2, 5});
  fusebox::RopeArgs a;
  a.q = q.view;
  a.q_out = qo.view;
  a.cos = a.sin = c.view;
  expect_error([&] { fusebox::rope(a); }, {"rotary dimension", "5", "even"});
}

TEST(Validation, RopeGridMustCoverSequence) {
  HostTensor q(DType::kFloat32, {1, 10, 1, 8}), qo(DType::kFloat32, {1, 10, 1, 8});
  fusebox::RopeArgs a;
  a.q = q.view;
  a.q_out = qo.view;
  a.use_grid = true;
  a.grid.frames = 2;
  a.grid.height = 2;
  a.grid.width = 3;
  a.grid.axes_dim[0] = 4;
  expect_error([&] { fusebox::rope(a); }, {"num_frames * height * width", "12", "10"});
}

TEST(Validation, RopeKMustMatchHeadDim) {
  HostTensor q(DType::kFloat32, {1, 2, 1, 8}), k(DType::kFloat32, {1, 2, 1, 6}), c(DType::kFloat32, {1, 2, 8});
  fusebox::RopeArgs a;
  a.q = q.view;
  a.q_out = q.view;
  a.k = k.view;
  a.k_out = k.view;
  a.cos = a.sin = c.view;
  expect_error([&] { fusebox::rope(a); }, {"k must match q"});
}

TEST(Validation, RopeNormWeightLength) {
  HostTensor q(DType::kFloat32, {1, 2, 3, 8}), c(DType::kFloat32, {1, 2, 8}), w(DType::kFloat32, {8});
  fusebox::RopeArgs a;
  a.q = a.q_out = q.view;
  a.cos = a.sin = c.view;
  a.norm = fusebox::NormType::kRMS;
  a.norm_across_heads = true;
  a.q_weight = w.view;
  expect_error([&] { fusebox::rope(a); }, {"q_weight", "24 elements"});
}

TEST(Validation, ActivationShapeMismatch) {
  HostTensor g(DType::kFloat32, {2, 8}), u(DType::kFloat32, {2, 7}), out(DType::kFloat32, {2, 8});
  expect_error([&] { fusebox::gated_activation(g.view, u.view, out.view, fusebox::Activation::kSiLU); }, {"up", "[2, 7]"});
}

TEST(Validation, TooManyUnmergeableRowDims) {
  // 5-D x whose every leading dim is strided differently cannot be walked with 3 row indices.
  HostTensor x(DType::kFloat32, {2, 2, 2, 2, 4}, {1000, 300, 50, 8, 1}), out(DType::kFloat32, {2, 2, 2, 2, 4});
  expect_error([&] { fusebox::rms_norm(x.view, TensorView{}, out.view, 1e-6f); }, {"leading dimensions"});
}
