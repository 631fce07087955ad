// pybind11 module megabert.fused_kernels._cpu, built ahead of time by setup.py.
#include "../bind_kernel_ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() =
      "megabert fused softmax, LayerNorm, RMSNorm, gated activation, RoPE, dropout + residual add, varlen attention and MLM cross "
      "entropy kernels for CPU (OpenMP across rows, "
      "vectorised rows)";
  megabert::def_kernel_ops(m, megabert::cpu::kernel_ops());
  m.def("dropout_add_forward", &megabert::cpu::dropout_add_forward,
        "residual + dropout(x) -> (out, keep mask); the mask from Philox4x32-10 keyed by seed", pybind11::arg("x"),
        pybind11::arg("residual"), pybind11::arg("p"), pybind11::arg("seed"));
  m.def("dropout_backward", &megabert::cpu::dropout_backward, "grad of dropout's input: mask * grad / (1 - p)",
        pybind11::arg("grad"), pybind11::arg("mask"), pybind11::arg("p"));
  m.def("varlen_attention_forward", &megabert::cpu::varlen_attention_forward,
        "attention over real tokens -> (out, lse); dropout drawn inside from Philox keyed by seed",
        pybind11::arg("q"), pybind11::arg("k"), pybind11::arg("v"), pybind11::arg("cu_seqlens"),
        pybind11::arg("scale"), pybind11::arg("p"), pybind11::arg("seed"), pybind11::arg("window_left") = -1,
        pybind11::arg("window_right") = -1);
  m.def("varlen_attention_backward", &megabert::cpu::varlen_attention_backward,
        "-> grad of the packed [T, 3, heads, d] q, k, v", pybind11::arg("grad_out"), pybind11::arg("q"),
        pybind11::arg("k"), pybind11::arg("v"), pybind11::arg("out"), pybind11::arg("lse"),
        pybind11::arg("cu_seqlens"), pybind11::arg("scale"), pybind11::arg("p"), pybind11::arg("seed"),
        pybind11::arg("window_left") = -1, pybind11::arg("window_right") = -1);
  m.def("varlen_attention_dropout_mask", &megabert::cpu::varlen_attention_dropout_mask,
        "the keep mask the attention kernels draw (for tests)", pybind11::arg("cu_seqlens"),
        pybind11::arg("heads"), pybind11::arg("p"), pybind11::arg("seed"));
  m.def("cross_entropy_lse", &megabert::cpu::cross_entropy_lse,
        "each row's log-sum-exp over column chunks of logits -> lse", pybind11::arg("chunks"));
  m.def("cross_entropy_grad", &megabert::cpu::cross_entropy_grad,
        "out = exp(logits - lse) * g for one chunk of logits (softmax times each row's loss grad)",
        pybind11::arg("logits"), pybind11::arg("lse"), pybind11::arg("g"), pybind11::arg("out"));
  m.def("rms_norm_forward", &megabert::cpu::rms_norm_forward,
        "RMSNorm over the last dim (Llama's: fp32 math, cast before the weight) -> (y, rstd)", pybind11::arg("x"),
        pybind11::arg("weight"), pybind11::arg("eps"));
  m.def("rms_norm_backward", &megabert::cpu::rms_norm_backward, "-> (grad_x, grad_weight)", pybind11::arg("grad_y"),
        pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("rstd"));
  m.def("gated_activation_forward", &megabert::cpu::gated_activation_forward,
        "act(input) * gate from u = [input; gate] ([gate; input] with gate_first) over the last dim",
        pybind11::arg("u"), pybind11::arg("activation"), pybind11::arg("gate_first"));
  m.def("gated_activation_backward", &megabert::cpu::gated_activation_backward, "-> grad_u, both halves in one pass",
        pybind11::arg("grad_y"), pybind11::arg("u"), pybind11::arg("activation"), pybind11::arg("gate_first"));
  m.def("rope_qkv_forward", &megabert::cpu::rope_qkv_forward,
        "the attention's input [rows, 3, heads, d]: Q and K rotated (RoPE), K and V repeated to their query heads",
        pybind11::arg("q"), pybind11::arg("kv"), pybind11::arg("cos"), pybind11::arg("sin"));
  m.def("rope_qkv_backward", &megabert::cpu::rope_qkv_backward,
        "-> [rows, heads + 2 kv_heads, d]: the grads of q, k and v (summed over each group)", pybind11::arg("grad"),
        pybind11::arg("cos"), pybind11::arg("sin"), pybind11::arg("kv_heads"));
  m.def("isa", &megabert::cpu::isa, "Instruction set the kernels run with: avx512, avx2 or default.");
}
