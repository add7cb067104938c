// The only PYBIND11_MODULE of lightningrl_fast._C: build facts, then one m.def per op, sorted by name.
// CUDA entry points exist only in a CUDA build (LRF_WITH_CUDA, set by setup.py / CMakeLists.txt).
#include <torch/extension.h>

#include <optional>
#include <string>
#include <tuple>

#ifndef LRF_CUDA_ARCHS
#define LRF_CUDA_ARCHS
#endif
#define LRF_STRINGIFY_(...) #__VA_ARGS__
#define LRF_STRINGIFY(...) LRF_STRINGIFY_(__VA_ARGS__)

namespace lrf {

#ifdef LRF_WITH_CUDA
// kv_cache.cu
void kv_cache_write(at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& k, const at::Tensor& v,
                    const at::Tensor& cache_lens, const at::Tensor& chunk_lens,
                    const std::optional<at::Tensor>& maybe_error_flag);
// unmask.cu
std::tuple<at::Tensor, at::Tensor> threshold_unmask(
    const at::Tensor& logits, const at::Tensor& tokens, const at::Tensor& masked, const at::Tensor& step_map,
    const at::Tensor& logp, const at::Tensor& conf, const at::Tensor& step, const at::Tensor& quota,
    const at::Tensor& eos_ids, const at::Tensor& seed, const at::Tensor& offset, double threshold,
    double temperature, int64_t top_k, double top_p, bool greedy);
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
  m.def("kv_cache_write", &lrf::kv_cache_write, "KV-cache write (in place; see ARCHITECTURE.md)",
        py::arg("k_cache"), py::arg("v_cache"), py::arg("k"), py::arg("v"), py::arg("cache_lens"),
        py::arg("chunk_lens"), py::arg("error_flag") = py::none());
  m.def("threshold_unmask", &lrf::threshold_unmask,
        "Threshold unmasking step (in place; returns (block_done, eos_seen); see ARCHITECTURE.md)",
        py::arg("logits"), py::arg("tokens"), py::arg("masked"), py::arg("step_map"), py::arg("logp"),
        py::arg("conf"), py::arg("step"), py::arg("quota"), py::arg("eos_ids"), py::arg("seed"),
        py::arg("offset"), py::arg("threshold"), py::arg("temperature"), py::arg("top_k"), py::arg("top_p"),
        py::arg("greedy"));
#endif
}
