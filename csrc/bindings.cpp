// The only PYBIND11_MODULE of lightningrl_fast._C: build facts, then one m.def per op, sorted by name.
// CUDA entry points exist only in a CUDA build (LRF_WITH_CUDA, set by setup.py / CMakeLists.txt).
#include <torch/extension.h>

#include <optional>
#include <string>

#ifndef LRF_CUDA_ARCHS
#define LRF_CUDA_ARCHS
#endif
#define LRF_STRINGIFY_(...) #__VA_ARGS__
#define LRF_STRINGIFY(...) LRF_STRINGIFY_(__VA_ARGS__)

namespace lrf {

#ifdef LRF_WITH_CUDA
// block_attn.cu
at::Tensor block_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache,
                           at::Tensor v_cache, const at::Tensor& cache_lens, const at::Tensor& chunk_lens,
                           int64_t block_size, double softmax_scale, int64_t num_splits);

// kv_cache.cu
void kv_cache_write(at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& k, const at::Tensor& v,
                    const at::Tensor& cache_lens, const at::Tensor& chunk_lens,
                    const std::optional<at::Tensor>& maybe_error_flag);
#endif

}  // namespace lrf

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.doc() = "lightningrl_fast C++/CUDA kernels; call them through lightningrl_fast.ops";

  m.def("has_cuda", [] {
#ifdef LRF_WITH_CUDA
    return true;
#else
    return false;
#endif
  }, "True when the module was compiled with its CUDA kernels.");
  m.def("cuda_archs", [] {
    std::string archs = LRF_STRINGIFY(LRF_CUDA_ARCHS);  // "90a,100a" -> "90a;100a"; "" in a CPU build
    for (char& c : archs) c = (c == ',') ? ';' : c;
    return archs;
  }, "The CUDA architectures compiled in, ';'-separated (e.g. '90a'); '' in a CPU-only build.");

#ifdef LRF_WITH_CUDA
  m.def("block_attention", &lrf::block_attention,
        "Block-causal attention of a chunk against the KV cache; writes the chunk's K/V into the caches "
        "(see ARCHITECTURE.md). num_splits: KV splits, 0 = chosen from the shapes and the device.",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("k_cache"), py::arg("v_cache"), py::arg("cache_lens"),
        py::arg("chunk_lens"), py::arg("block_size"), py::arg("softmax_scale"), py::arg("num_splits") = 0);
  m.def("kv_cache_write", &lrf::kv_cache_write, "KV-cache write (in place; see ARCHITECTURE.md)",
        py::arg("k_cache"), py::arg("v_cache"), py::arg("k"), py::arg("v"), py::arg("cache_lens"),
        py::arg("chunk_lens"), py::arg("error_flag") = py::none());
#endif
}
