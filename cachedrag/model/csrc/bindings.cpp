// The Python module of the native library: its entry points and the fused step's class.
#include "native.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "one query row per head over KV rows, split-K (cachedrag)");
  m.def("decode_attention_batch", &decode_attention_batch, "decode_attention for B requests in one call (cachedrag)");
  m.def("prefill_attention", &prefill_attention, "sorted query positions over KV rows, causal by position (cachedrag)");
  m.def("prefill_attention_available", &prefill_attention_available, "whether prefill_attention was built (AVX-512)");
  m.def("int4_available", &int4_available, "whether the fused decode step reads int4 weights (AVX512-BF16)");
  m.def("int4_dequantize", &int4_dequantize, "int4 tiles -> the bf16 weight (cachedrag)", pybind11::arg("tiles"),
        pybind11::arg("rows"), pybind11::arg("out") = pybind11::none(), pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("int4_linear", &int4_linear, "x @ W^T (+ bias) from int4 tiles, few rows (cachedrag)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  register_fused_decode(m);
  register_int8_tiles(m);
}
