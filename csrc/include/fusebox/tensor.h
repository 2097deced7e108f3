// Plain tensor views: what every fusebox entry point takes. No framework types.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace fusebox {

// The floating-point types are what the ops compute on; the integer types only index (moe_combine).
enum class DType : int8_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2, kInt32 = 3, kInt64 = 4 };
enum class Device : int8_t { kCPU = 0, kCUDA = 1 };

size_t dtype_size(DType dtype);
const char* dtype_name(DType dtype);

constexpr int kMaxDims = 8;

// A strided view of memory owned by the caller. Shapes and strides count elements.
// A view with data == nullptr and ndim == 0 means "not given" for optional operands;
// an empty tensor (some dimension 0) must still carry its shape.
struct TensorView {
  void* data = nullptr;
  DType dtype = DType::kFloat32;
  Device device = Device::kCPU;
  int ndim = 0;
  int64_t shape[kMaxDims] = {};
  int64_t strides[kMaxDims] = {};

  bool defined() const { return ndim > 0 || data != nullptr; }
  int64_t numel() const;
  int64_t size(int dim) const { return shape[dim < 0 ? dim + ndim : dim]; }
  int64_t stride(int dim) const { return strides[dim < 0 ? dim + ndim : dim]; }
  std::string shape_str() const;
};

// Helper for C++ callers: a contiguous view of `shape`.
TensorView make_view(void* data, DType dtype, Device device, std::initializer_list<int64_t> shape);

}  // namespace fusebox
