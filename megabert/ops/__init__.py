"""Front ends for the numerically heavy ops; each picks its backend once.

`scaled_masked_softmax`, `layer_norm`, `rms_norm`, `gated_activation`, `dropout_add` and
`varlen_attention` run the fused kernel when it is built and the shape is within its limits,
and PyTorch otherwise;
`bias_gelu` and `bias_dropout_add_layer_norm`, the layers' GEMM epilogues, run fused as
torch.compile'd functions with the 'compiled' backend (megabert.ops.epilogues). The PyTorch versions in
`megabert.ops.reference` are the oracle the kernels are tested against.
"""
from megabert.ops.attention import core_attention, resolve_attention_backend
from megabert.ops.dropout_add import bias_dropout_add_layer_norm, dropout_add, resolve_dropout_add_backend
from megabert.ops.epilogues import bias_gelu
from megabert.ops.gated_activation import gated_activation
from megabert.ops.layer_norm import layer_norm, resolve_layernorm_backend
from megabert.ops.rms_norm import rms_norm
from megabert.ops.softmax import scaled_masked_softmax
from megabert.ops.varlen_attention import varlen_attention

__all__ = ["scaled_masked_softmax", "layer_norm", "rms_norm", "gated_activation", "dropout_add", "core_attention",
           "varlen_attention", "bias_gelu", "bias_dropout_add_layer_norm",
           "resolve_attention_backend",
           "resolve_layernorm_backend", "resolve_dropout_add_backend"]
