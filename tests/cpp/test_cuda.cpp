// CUDA kernels against the CPU reference on the same inputs (skipped without a GPU). Outputs
// are poisoned with NaN before each launch, so an unwritten element fails.
#include <random>

#include "test_util.h"

using namespace fbtest;

namespace {

const DType kDtypes[] = {DType::kFloat32, DType::kFloat16, DType::kBFloat16};

// Integer outputs (indices) must match exactly.
double tol(DType d) {
  if (d == DType::kInt32 || d == DType::kInt64) return 1e-12;
  return d == DType::kFloat32 ? 2e-6 : 1e-2;
}

// Runs `call` on CPU views and on device mirrors of the same tensors, then compares `outputs`.
void compare_devices(std::vector<HostTensor*> inputs, std::vector<HostTensor*> outputs,
                     const std::function<void(const std::vector<TensorView>&, const std::vector<TensorView>&)>& call,
                     const std::string& what) {
  std::vector<HostTensor> cpu_out;
  for (auto* o : outputs) {
    o->fill(NAN);
    cpu_out.push_back(*o);
    cpu_out.back().view.data = cpu_out.back().storage.data();
  }
  std::vector<TensorView> in_views, out_views;
  for (auto* i : inputs) in_views.push_back(i->view);
  for (auto& o : cpu_out) out_views.push_back(o.view);
  call(in_views, out_views);

  std::vector<std::unique_ptr<DeviceMirror>> din, dout;
  in_views.clear();
  out_views.clear();
  for (auto* i : inputs) {
    din.push_back(std::make_unique<DeviceMirror>(*i));
    in_views.push_back(din.back()->view);
  }
  for (auto* o : outputs) {
    dout.push_back(std::make_unique<DeviceMirror>(*o));
    ASSERT_EQ(cudaMemset(dout.back()->ptr, 0xff, o->storage.size()), cudaSuccess);  // NaN in every dtype
    out_views.push_back(dout.back()->view);
  }
  call(in_views, out_views);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess) << what;
  for (size_t i = 0; i < outputs.size(); ++i) {
    dout[i]->copy_back();
    EXPECT_LT(rel_error(*outputs[i], cpu_out[i]), tol(outputs[i]->view.dtype)) << what << " output " << i;
  }
}

class CudaVsCpu : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!has_cuda()) GTEST_SKIP() << "no CUDA device";
  }
  std::mt19937 rng{42};
};

}  // namespace

TEST_F(CudaVsCpu, NormFamily) {
  for (DType dt : kDtypes)
    for (int64_t width : {1, 7, 128, 769, 2048, 5125, 16384, 40000})
      for (int variant = 0; variant < 4; ++variant) {
        const int64_t B = 2, S = width > 5000 ? 3 : 17;
        const std::string what = std::string(fusebox::dtype_name(dt)) + " width " + std::to_string(width) +
                                 " variant " + std::to_string(variant);
        // x is a strided view (rows padded by 8 elements) for variants 1 and 3.
        const bool strided = variant % 2 == 1;
        HostTensor x(dt, {B, S, width}, strided ? std::vector<int64_t>{S * (width + 8), width + 8, 1} : std::vector<int64_t>{});
        HostTensor branch(dt, {B, S, width}), w(DType::kFloat32, {width}), bias(dt, {width});
        HostTensor mod(dt, {B, 3, width});  // gate, scale, shift rows per sample
        HostTensor out(variant == 3 ? DType::kFloat32 : dt, {B, S, width}), h(dt, {B, S, width});
        for (auto* t : {&x, &branch, &bias}) t->fill_random(rng);
        w.fill_random(rng, 1.f, 0.2f);
        mod.fill_random(rng, 0.f, 0.5f);
        auto mod_row = [&](const TensorView& base, int i) {
          TensorView v = x.view;
          v.dtype = dt;
          v.device = base.device;
          v.data = static_cast<char*>(base.data) + i * width * fusebox::dtype_size(dt);
          v.strides[0] = 3 * width;
          v.strides[1] = 0;
          v.strides[2] = 1;
          return v;
        };
        compare_devices({&x, &branch, &w, &bias, &mod}, {&out, &h},
                        [&](const std::vector<TensorView>& in, const std::vector<TensorView>& o) {
                          fusebox::NormArgs a;
                          a.x = in[0];
                          a.out = o[0];
                          a.eps = 1e-6f;
                          switch (variant) {
                            case 0:  // rms_norm with fp32 weight, Gemma offset
                              a.weight = in[2];
                              a.weight_offset = 1.f;
                              break;
                            case 1:  // layer norm with weight and bias
                              a.norm = fusebox::NormType::kLayer;
                              a.weight = in[2];
                              a.bias = in[3];
                              break;
                            case 2:  // gated residual + RMS adaln (per-sample broadcast)
                              a.branch = in[1];
                              a.residual_out = o[1];
                              a.gate = mod_row(in[4], 0);
                              a.scale = mod_row(in[4], 1);
                              a.shift = mod_row(in[4], 2);
                              break;
                            default:  // fused add + layer adaln, fp32 output
                              a.norm = fusebox::NormType::kLayer;
                              a.branch = in[1];
                              a.residual_out = o[1];
                              a.scale = mod_row(in[4], 1);
                              break;
                          }
                          if (variant < 2) {
                            // h is not written: keep the comparison meaningful by writing it here.
                            fusebox::NormArgs g;
                            g.x = in[0];
                            g.branch = in[1];
                            g.residual_out = o[1];
                            g.norm = fusebox::NormType::kNone;
                            fusebox::norm(g);
                          }
                          fusebox::norm(a);
                        },
                        what);
      }
}

TEST_F(CudaVsCpu, RotaryFamily) {
  struct Case {
    int64_t B, S, Hq, Hk, D, R;
    bool interleaved, norm, across, grid;
  };
  const Case cases[] = {
      {2, 33, 8, 2, 128, 128, false, false, false, false},  // Llama/GQA
      {1, 20, 4, 4, 64, 32, false, false, false, false},    // partial rotary
      {2, 17, 1, 1, 2048, 2048, true, true, true, false},   // LTX flat, across-head norm
      {1, 31, 6, 6, 128, 128, true, true, false, false},    // Flux per-head norm
      {1, 2 * 3 * 5, 3, 3, 128, 128, true, false, false, true},  // Wan grid
      {1, 13, 5, 5, 128, 128, true, true, true, false},     // Wan: norm across several heads
      {2, 7, 4, 2, 128, 64, false, true, false, false},     // Qwen3-like per-head norm, partial
      {1, 9, 2, 1, 6, 6, false, true, false, false},        // tiny head_dim, scalar vectors
  };
  for (DType dt : kDtypes)
    for (const Case& c : cases) {
      const std::string what = std::string(fusebox::dtype_name(dt)) + " D " + std::to_string(c.D) + " S " + std::to_string(c.S);
      // q is a strided view into a fused [B, S, Hq + 2 * Hk, D] projection.
      const int64_t Ht = c.Hq + 2 * c.Hk;
      HostTensor q(dt, {c.B, c.S, c.Hq, c.D}, {c.S * Ht * c.D, Ht * c.D, c.D, 1});
      HostTensor k(dt, {c.B, c.S, c.Hk, c.D}), qo(dt, {c.B, c.S, c.Hq, c.D}), ko(dt, {c.B, c.S, c.Hk, c.D});
      HostTensor cs(DType::kFloat32, {c.B, c.S, c.R}), sn(DType::kFloat32, {c.B, c.S, c.R});
      HostTensor qw(dt, {c.across ? c.Hq * c.D : c.D}), kw(dt, {c.across ? c.Hk * c.D : c.D});
      for (auto* t : {&q, &k, &cs, &sn}) t->fill_random(rng);
      qw.fill_random(rng, 1.f, 0.2f);
      kw.fill_random(rng, 1.f, 0.2f);
      compare_devices({&q, &k, &cs, &sn, &qw, &kw}, {&qo, &ko},
                      [&](const std::vector<TensorView>& in, const std::vector<TensorView>& o) {
                        fusebox::RopeArgs a;
                        a.q = in[0];
                        a.k = in[1];
                        a.q_out = o[0];
                        a.k_out = o[1];
                        if (c.grid) {
                          a.use_grid = true;
                          a.grid.frames = 2;
                          a.grid.height = 3;
                          a.grid.width = 5;
                          a.grid.axes_dim[0] = 44;
                          a.grid.axes_dim[1] = 42;
                          a.grid.axes_dim[2] = 42;
                        } else {
                          a.cos = in[2];
                          a.sin = in[3];
                        }
                        a.style = c.interleaved ? fusebox::RopeStyle::kInterleaved : fusebox::RopeStyle::kHalfSplit;
                        if (c.norm) {
                          a.norm = fusebox::NormType::kRMS;
                          a.norm_across_heads = c.across;
                          a.q_weight = in[4];
                          a.k_weight = in[5];
                          a.eps = 1e-6f;
                        }
                        fusebox::rope(a);
                      },
                      what);
    }
}

TEST_F(CudaVsCpu, ActivationFamily) {
  for (DType dt : kDtypes)
    for (int64_t n : {1, 7, 768, 5125, 14336})
      for (auto act : {fusebox::Activation::kSiLU, fusebox::Activation::kGeluTanh, fusebox::Activation::kGelu}) {
        const int64_t rows = n > 5000 ? 5 : 19;
        HostTensor packed(dt, {rows, 2 * n}), bias(DType::kFloat32, {n}), out(dt, {rows, n}), out2(dt, {rows, n});
        packed.fill_random(rng, 0.f, 2.f);
        bias.fill_random(rng);
        compare_devices({&packed, &bias}, {&out, &out2},
                        [&](const std::vector<TensorView>& in, const std::vector<TensorView>& o) {
                          TensorView gate = in[0], up = in[0];
                          gate.shape[1] = up.shape[1] = n;
                          up.data = static_cast<char*>(up.data) + n * fusebox::dtype_size(dt);
                          fusebox::gated_activation(up, gate, o[0], act);  // gate second (diffusers)
                          fusebox::activation(gate, in[1], o[1], act);
                        },
                        std::string(fusebox::dtype_name(dt)) + " n " + std::to_string(n));
      }
}

TEST_F(CudaVsCpu, MoeFamily) {
  for (DType dt : kDtypes)
    for (int64_t width : {1, 7, 768, 2056, 7168})
      for (int64_t top_k : {1, 6, 8, 11}) {
        const int64_t tokens = 13, num_rows = tokens * top_k;
        // rows strided past their width (vectors narrower where the stride allows less)
        HostTensor rows(dt, {num_rows, width}, {width + 8, 1}), index(DType::kInt64, {tokens, top_k}),
            weights(DType::kFloat32, {tokens, top_k}), out(dt, {tokens, width});
        rows.fill_random(rng);
        std::uniform_int_distribution<int64_t> pick(0, num_rows - 1);
        for (int64_t i = 0; i < tokens * top_k; ++i) {
          index.set(i, float(pick(rng)));
          weights.set(i, 0.1f + 0.01f * float(i % 37));
        }
        compare_devices({&rows, &index, &weights}, {&out},
                        [&](const std::vector<TensorView>& in, const std::vector<TensorView>& o) {
                          fusebox::moe_combine(in[0], in[1], in[2], o[0]);
                        },
                        std::string(fusebox::dtype_name(dt)) + " width " + std::to_string(width) + " top_k " +
                            std::to_string(top_k));
      }
}

// The router's top-k against the CPU's: the same experts (random logits have no near-equal
// scores at these sizes) and weights within the fp32 sums' order. Softmax and sigmoid scores, a
// bias of each dtype, group-limited choices (DeepSeek-V3's 8 groups of 32, top-4 groups).
TEST_F(CudaVsCpu, MoeTopkMatchesCpu) {
  struct Case {
    int64_t experts, top_k, groups, topk_groups;
    fusebox::RouterScore score;
  };
  const Case cases[] = {{1, 1, 1, 1, fusebox::RouterScore::kSoftmax},   {8, 2, 1, 1, fusebox::RouterScore::kSoftmax},
                        {60, 6, 1, 1, fusebox::RouterScore::kSoftmax},  {257, 8, 1, 1, fusebox::RouterScore::kSoftmax},
                        {1024, 32, 1, 1, fusebox::RouterScore::kSoftmax}, {64, 6, 1, 1, fusebox::RouterScore::kSigmoid},
                        {256, 8, 8, 4, fusebox::RouterScore::kSigmoid}, {160, 6, 8, 3, fusebox::RouterScore::kSigmoid},
                        {128, 8, 4, 1, fusebox::RouterScore::kSoftmax}};
  for (DType dt : kDtypes)
    for (const Case& c : cases) {
      const int64_t tokens = 37;
      HostTensor logits(dt, {tokens, c.experts}, {c.experts + 3, 1}), weights(DType::kFloat32, {tokens, c.top_k}),
          index(DType::kInt64, {tokens, c.top_k}), bias(dt, {c.experts});
      logits.fill_random(rng, 0.f, 3.f);
      bias.fill_random(rng, 0.f, 0.1f);
      const bool with_bias = c.score == fusebox::RouterScore::kSigmoid;
      compare_devices({&logits, &bias}, {&weights, &index},
                      [&](const std::vector<TensorView>& in, const std::vector<TensorView>& o) {
                        fusebox::RouterArgs a;
                        a.logits = in[0];
                        if (with_bias) a.bias = in[1];
                        a.weights = o[0];
                        a.index = o[1];
                        a.score = c.score;
                        a.num_groups = c.groups;
                        a.topk_groups = c.topk_groups;
                        a.renormalize = c.top_k % 2 == 0;
                        a.scale = 1.5f;
                        fusebox::moe_topk(a);
                      },
                      std::string(fusebox::dtype_name(dt)) + " experts " + std::to_string(c.experts) + " top_k " +
                          std::to_string(c.top_k) + " groups " + std::to_string(c.groups));
    }
}

// The sort's outputs are integers: equal to the CPU's element for element. Sizes from one pair to
// several rounds of every warp and tens of tiles, experts from one to enough that fewer warps fit
// the counts, index int32 and int64, row-major and column-major, outputs poisoned (-1 in every
// element), over many blocks (int64 index, given the workspace, itself poisoned: the size for any
// device, or for this one, which is never more) and in one block or cluster (int32 index, none).
TEST_F(CudaVsCpu, MoeSortMatchesCpu) {
  for (int64_t num_experts : {1, 8, 64, 257, 3001})
    for (int64_t tokens : {1, 333, 4099})
      for (int64_t top_k : {1, 6, 8})
        for (DType idx : {DType::kInt32, DType::kInt64}) {
          const bool column_major = top_k == 6;
          const std::vector<int64_t> strides = column_major ? std::vector<int64_t>{1, tokens} : std::vector<int64_t>{};
          HostTensor index(idx, {tokens, top_k}, strides);
          // mostly a few hot experts (many lanes of a warp on one), the rest spread
          std::uniform_int_distribution<int64_t> any(0, num_experts - 1), hot(0, std::min<int64_t>(num_experts, 3) - 1);
          std::bernoulli_distribution is_hot(0.5);
          for (int64_t i = 0; i < tokens * top_k; ++i) index.set(i, float(is_hot(rng) ? hot(rng) : any(rng)));
          HostTensor row_token(DType::kInt32, {tokens * top_k}), offsets(DType::kInt32, {num_experts}),
              pair_row(DType::kInt32, {tokens, top_k});
          fusebox::moe_sort(index.view, num_experts, row_token.view, offsets.view, pair_row.view);
          HostTensor got_row_token = row_token, got_offsets = offsets, got_pair_row = pair_row;
          for (HostTensor* t : {&got_row_token, &got_offsets, &got_pair_row}) t->view.data = t->storage.data();
          DeviceMirror dindex(index), drow_token(got_row_token), doffsets(got_offsets), dpair_row(got_pair_row);
          const int64_t any_device = fusebox::moe_sort_workspace_size(tokens, top_k, num_experts),
                        this_device = fusebox::moe_sort_workspace_size(tokens, top_k, num_experts, true);
          EXPECT_LE(this_device, any_device) << tokens << " x " << top_k << " of " << num_experts;
          const int64_t workspace_size = idx == DType::kInt32 ? 0 : top_k == 8 ? any_device : this_device;
          HostTensor workspace(DType::kInt32, {std::max<int64_t>(workspace_size, 1)});
          DeviceMirror dworkspace(workspace);
          for (DeviceMirror* d : {&drow_token, &doffsets, &dpair_row, &dworkspace})
            ASSERT_EQ(cudaMemset(d->ptr, 0xff, d->host->storage.size()), cudaSuccess);
          fusebox::moe_sort(dindex.view, num_experts, drow_token.view, doffsets.view, dpair_row.view, nullptr,
                            workspace_size > 0 ? dworkspace.view : TensorView{});
          const std::string what = std::string(fusebox::dtype_name(idx)) + " experts " + std::to_string(num_experts) +
                                   " tokens " + std::to_string(tokens) + " top_k " + std::to_string(top_k) +
                                   " workspace " + std::to_string(workspace_size);
          ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess) << what;
          for (DeviceMirror* d : {&drow_token, &doffsets, &dpair_row}) d->copy_back();
          int64_t differ = 0;
          for (int64_t i = 0; i < tokens * top_k; ++i)
            differ += (got_row_token.at(i) != row_token.at(i)) + (got_pair_row.at(i) != pair_row.at(i));
          for (int64_t e = 0; e < num_experts; ++e) differ += got_offsets.at(e) != offsets.at(e);
          EXPECT_EQ(differ, 0) << what;
        }
}

// On sm_90+ an index of up to 2048 pairs (4096 where clusters of 16 fit) takes one cluster and
// reads no workspace, which the PyTorch operator then does not allocate; before sm_90 this device
// needs the size for any device.
TEST_F(CudaVsCpu, MoeSortWorkspaceForThisDevice) {
  int major = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0), cudaSuccess);
  struct Case {
    int64_t tokens, top_k, experts;
  };
  for (const Case c : {Case{1024, 2, 8}, Case{1000, 2, 64}, Case{256, 8, 256}}) {
    const int64_t any_device = fusebox::moe_sort_workspace_size(c.tokens, c.top_k, c.experts);
    EXPECT_GT(any_device, 0) << c.tokens << " x " << c.top_k;
    EXPECT_EQ(fusebox::moe_sort_workspace_size(c.tokens, c.top_k, c.experts, true), major >= 9 ? 0 : any_device)
        << c.tokens << " x " << c.top_k << " of " << c.experts << " on sm_" << major << "x";
  }
  // past one cluster's pairs the tiles' counts are needed everywhere
  EXPECT_EQ(fusebox::moe_sort_workspace_size(8192, 8, 256, true), fusebox::moe_sort_workspace_size(8192, 8, 256));
}

// CUDA cannot raise on an index outside the rows without a host sync: that token's row turns
// NaN, the others are written as usual, and nothing outside the rows is read.
TEST_F(CudaVsCpu, MoeCombineIndexOutsideRowsIsNaN) {
  HostTensor rows(DType::kBFloat16, {4, 64}), index(DType::kInt32, {2, 2}), weights(DType::kFloat32, {2, 2}),
      out(DType::kBFloat16, {2, 64});
  rows.fill_random(rng);
  weights.fill(0.5f);
  index.set(0, 1);
  index.set(1, 2);
  index.set(2, 3);
  index.set(3, -5);
  DeviceMirror drows(rows), dindex(index), dweights(weights), dout(out);
  fusebox::moe_combine(drows.view, dindex.view, dweights.view, dout.view);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  dout.copy_back();
  for (int64_t d = 0; d < 64; ++d) {
    EXPECT_NEAR(out.at(d), 0.5 * rows.at(64 + d) + 0.5 * rows.at(128 + d), 1e-2 * (1 + std::abs(out.at(d))));
    EXPECT_TRUE(std::isnan(out.at(64 + d))) << d;
  }
}
