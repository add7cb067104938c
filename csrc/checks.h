// Input checks for the launchers: LRF_CHECK (TORCH_CHECK with the message built by lrf::msg) with messages
// that name the argument.
//
// Every launcher checks everything a caller can get wrong, so the extension is safe to call directly
// (the Python wrappers check first and give the same kind of message).
//
// Why lrf::msg and not TORCH_CHECK's own formatting: TORCH_CHECK streams every argument into a
// std::ostringstream, so a number goes through the std::num_put facet of whichever libstdc++ the process
// loaded. On the first lent GPU image (RESULTS.md, 2026-11-22) an extension built with that image's /opt/gcc
// crashed in exactly those messages (numbers, size lists) while messages made of strings, dtypes and devices
// raised fine: the signature of newer libstdc++ headers running against an older libstdc++. lrf::msg formats
// numbers with std::to_string / snprintf and hands TORCH_CHECK one std::string, which c10::str passes through
// without a stream; the text is the same as the stream would give ("[2, 3]", "BFloat16", "cuda:0", "%g").
#pragma once

#include <ATen/MemoryOverlap.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdio>
#include <initializer_list>
#include <string>
#include <type_traits>

// The CUDA architectures the extension was compiled for, as the build passes them (-DLRF_CUDA_ARCHS=90a,100a by
// setup.py and CMakeLists.txt); "" in a CPU-only build.
#ifndef LRF_CUDA_ARCHS
#define LRF_CUDA_ARCHS
#endif
#define LRF_STRINGIFY_(...) #__VA_ARGS__
#define LRF_STRINGIFY(...) LRF_STRINGIFY_(__VA_ARGS__)

namespace lrf {

inline constexpr const char* kCudaArchs = LRF_STRINGIFY(LRF_CUDA_ARCHS);

namespace detail {

inline void put(std::string& s, const char* v) { s += v; }
inline void put(std::string& s, const std::string& v) { s += v; }
inline void put(std::string& s, char v) { s += v; }
inline void put(std::string& s, bool v) { s += v ? "true" : "false"; }
template <typename T, std::enable_if_t<std::is_integral_v<T>, int> = 0>
inline void put(std::string& s, T v) {
  s += std::to_string(v);
}
inline void put(std::string& s, double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", v);  // what a default-formatted ostream prints
  s += buf;
}
inline void put(std::string& s, float v) { put(s, static_cast<double>(v)); }
inline void put(std::string& s, c10::IntArrayRef v) {
  s += '[';
  for (size_t i = 0; i < v.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(v[i]);
  }
  s += ']';
}
inline void put(std::string& s, at::ScalarType v) { s += c10::toString(v); }
inline void put(std::string& s, const c10::Device& v) { s += v.str(); }

}  // namespace detail

// The concatenation of `args` as text (strings, integers, floating point, size lists, dtypes, devices).
template <typename... Args>
std::string msg(const Args&... args) {
  std::string s;
  (detail::put(s, args), ...);
  return s;
}

// True when t.scalar_type() is one of `allowed`.
inline bool dtype_in(const at::Tensor& t, std::initializer_list<at::ScalarType> allowed) {
  for (auto d : allowed) {
    if (t.scalar_type() == d) return true;
  }
  return false;
}

}  // namespace lrf

// TORCH_CHECK(cond, message) with the message built by lrf::msg (only when cond fails).
#define LRF_CHECK(cond, ...) TORCH_CHECK((cond), ::lrf::msg(__VA_ARGS__))

#define CHECK_CUDA(x) LRF_CHECK((x).is_cuda(), #x " must be a CUDA tensor, got device ", (x).device())

#define CHECK_CONTIGUOUS(x) \
  LRF_CHECK((x).is_contiguous(), #x " must be contiguous, got strides ", (x).strides())

// The last dimension is dense (stride 1); the other strides are free.
#define CHECK_LAST_DIM_CONTIGUOUS(x)                                                         \
  LRF_CHECK((x).dim() >= 1 && ((x).size(-1) <= 1 || (x).stride(-1) == 1), #x            \
              " must have a contiguous last dimension (stride 1), got strides ", (x).strides())

#define CHECK_DTYPE(x, dtype) \
  LRF_CHECK((x).scalar_type() == (dtype), #x " must have dtype ", (dtype), ", got ", (x).scalar_type())

// CHECK_DTYPE_IN(x, at::kHalf, at::kBFloat16): one of the listed dtypes.
#define CHECK_DTYPE_IN(x, ...)                                                               \
  LRF_CHECK(::lrf::dtype_in((x), {__VA_ARGS__}), #x " must have dtype in (" #__VA_ARGS__ \
              "), got ", (x).scalar_type())

#define CHECK_SAME_DTYPE(x, y)                                                               \
  LRF_CHECK((x).scalar_type() == (y).scalar_type(), #x " and " #y " must have the same dtype, got ", \
              (x).scalar_type(), " and ", (y).scalar_type())

#define CHECK_SAME_DEVICE(x, y)                                                                \
  LRF_CHECK((x).device() == (y).device(), #x " is on ", (x).device(), " but " #y " is on ", \
              (y).device())

#define CHECK_DIM(x, n) \
  LRF_CHECK((x).dim() == (n), #x " must have ", (n), " dimensions, got shape ", (x).sizes())

// CHECK_SHAPE(x, B, L, H, D): exact sizes.
#define CHECK_SHAPE(x, ...)                                                                  \
  LRF_CHECK((x).sizes() == at::IntArrayRef({__VA_ARGS__}), #x " must have shape [" #__VA_ARGS__ "] = ", \
              at::IntArrayRef({__VA_ARGS__}), ", got ", (x).sizes())

// A tensor the kernel writes in place: no two of its elements may share memory (an expanded, stride-0 view
// would make the kernel's rows race). Layouts too complex to decide are let through.
#define CHECK_NO_INTERNAL_OVERLAP(x)                                                                        \
  LRF_CHECK(at::has_internal_overlap(x) != at::MemOverlap::Yes, #x                                           \
              " is written in place and must not have elements that share memory (an expanded view?), got strides ", \
              (x).strides())

namespace lrf {

// A tensor and its name, for check_no_overlaps.
struct Named {
  const char* name;
  const at::Tensor& t;
};

// The launcher-side twin of ops/_common.py check_no_overlap: the tensors a kernel writes in place (`written`)
// must not share memory with each other, nor with a tensor the same launch reads (`read`): other CTAs of the
// grid read those while it writes, in no fixed order. Certain overlaps only (at::get_overlap_status: dense
// layouts); layouts too complex to decide are let through. Empty tensors never overlap; an undefined tensor (an
// absent optional argument) takes no part.
inline void check_no_overlaps(std::initializer_list<Named> written, std::initializer_list<Named> read) {
  auto overlap = [](const at::Tensor& a, const at::Tensor& b) {
    if (!a.defined() || !b.defined()) return false;
    const at::MemOverlapStatus s = at::get_overlap_status(a, b);
    return s == at::MemOverlapStatus::Full || s == at::MemOverlapStatus::Partial;
  };
  for (auto w = written.begin(); w != written.end(); ++w) {
    for (auto o = w + 1; o != written.end(); ++o) {
      LRF_CHECK(!overlap(w->t, o->t), w->name, " and ", o->name, " are both written in place and must not share memory");
    }
    for (const Named& r : read) {
      LRF_CHECK(!overlap(w->t, r.t), w->name, " is written in place and must not share memory with ", r.name,
                " (also read by this op)");
    }
  }
}

}  // namespace lrf
