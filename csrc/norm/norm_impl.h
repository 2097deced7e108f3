// Internal interface between the norm entry point (validation, layout) and its backends.
#pragma once

#include "common/layout.h"
#include "fusebox/ops.h"

namespace fusebox {

// Row strides of each row-shaped operand of NormArgs, from detail::merge_rows.
struct NormStrides {
  detail::RowStrides x, branch, gate, scale, shift, out, residual_out;
};

namespace cuda {
void norm_cuda(const NormArgs& args, const detail::RowLayout& layout, const NormStrides& strides,
               int vec, cudaStream_t stream);
}
namespace cpu {
void norm_cpu(const NormArgs& args, const detail::RowLayout& layout, const NormStrides& strides);
}

}  // namespace fusebox
