// Input checks for the launchers: TORCH_CHECK with messages that name the argument.
//
// Every launcher checks everything a caller can get wrong, so the extension is safe to call directly
// (the Python wrappers check first and give the same kind of message).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <initializer_list>

namespace lrf {

// True when t.scalar_type() is one of `allowed`.
inline bool dtype_in(const at::Tensor& t, std::initializer_list<at::ScalarType> allowed) {
  for (auto d : allowed) {
    if (t.scalar_type() == d) return true;
  }
  return false;
}

}  // namespace lrf

#define CHECK_CUDA(x) TORCH_CHECK((x).is_cuda(), #x " must be a CUDA tensor, got device ", (x).device())

#define CHECK_CONTIGUOUS(x) \
  TORCH_CHECK((x).is_contiguous(), #x " must be contiguous, got strides ", (x).strides())

// The last dimension is dense (stride 1); the other strides are free.
#define CHECK_LAST_DIM_CONTIGUOUS(x)                                                         \
  TORCH_CHECK((x).dim() >= 1 && ((x).size(-1) <= 1 || (x).stride(-1) == 1), #x            \
              " must have a contiguous last dimension (stride 1), got strides ", (x).strides())

#define CHECK_DTYPE(x, dtype) \
  TORCH_CHECK((x).scalar_type() == (dtype), #x " must have dtype ", (dtype), ", got ", (x).scalar_type())

// CHECK_DTYPE_IN(x, at::kHalf, at::kBFloat16): one of the listed dtypes.
#define CHECK_DTYPE_IN(x, ...)                                                               \
  TORCH_CHECK(::lrf::dtype_in((x), {__VA_ARGS__}), #x " must have dtype in (" #__VA_ARGS__ \
              "), got ", (x).scalar_type())

#define CHECK_SAME_DTYPE(x, y)                                                               \
  TORCH_CHECK((x).scalar_type() == (y).scalar_type(), #x " and " #y " must have the same dtype, got ", \
              (x).scalar_type(), " and ", (y).scalar_type())

#define CHECK_SAME_DEVICE(x, y)                                                                \
  TORCH_CHECK((x).device() == (y).device(), #x " is on ", (x).device(), " but " #y " is on ", \
              (y).device())

#define CHECK_DIM(x, n) \
  TORCH_CHECK((x).dim() == (n), #x " must have ", (n), " dimensions, got shape ", (x).sizes())

// CHECK_SHAPE(x, B, L, H, D): exact sizes.
#define CHECK_SHAPE(x, ...)                                                                  \
  TORCH_CHECK((x).sizes() == at::IntArrayRef({__VA_ARGS__}), #x " must have shape [" #__VA_ARGS__ "] = ", \
              at::IntArrayRef({__VA_ARGS__}), ", got ", (x).sizes())
