"""EncoderSpec: what an encoder is built from, as data (STYLE.md habit 15).

One set of modules (megabert.model: embeddings, attention, MLP, layer, backbone, MLM head)
reads this spec; a model family (megabert.families) is the function that maps its
config onto it. Nothing here knows a family's name: a BERT is post-LN with learned positions,
token types and a GELU MLP, a ModernBERT pre-LN with RoPE, windows and a GeGLU, and so on.

Every part is a frozen dataclass checked in __post_init__, so a spec that could not be built
(a head count that does not divide, a window on a layer type that does not exist) stops where
it is made, with one line.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional

from megabert.errors import ConfigError

NORM_KINDS = ("layernorm", "rmsnorm")
MLP_KINDS = ("plain", "glu")  # plain: act(W1 x) -> W2; glu: act(input) * gate
ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu", "silu", "swish")
POOLINGS = ("pooler", "cls", "mean", "late")


def _need(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


@dataclass(frozen=True)
class NormSpec:
    """The normalisation every norm of the model uses."""

    kind: str = "layernorm"
    """layernorm or rmsnorm."""
    eps: float = 1e-12
    bias: bool = True
    """LayerNorm with a bias (RMSNorm has none)."""

    def __post_init__(self):
        _need(self.kind in NORM_KINDS, f"norm kind must be one of {NORM_KINDS}, got {self.kind!r}")
        _need(self.eps > 0, f"norm eps must be positive, got {self.eps}")
        _need(not (self.kind == "rmsnorm" and self.bias), "RMSNorm has no bias")


@dataclass(frozen=True)
class EmbeddingSpec:
    max_positions: int = 0
    """Rows of the learned position table; 0: none (positions come from RoPE)."""
    type_vocab_size: int = 0
    """Rows of the token-type table; 0: none."""
    norm: bool = True
    """A norm after the embeddings sum."""
    dropout: float = 0.0

    def __post_init__(self):
        _need(self.max_positions >= 0 and self.type_vocab_size >= 0, "embedding table sizes must be >= 0")
        _need(0.0 <= self.dropout < 1.0, f"embedding dropout must be in [0, 1), got {self.dropout}")


@dataclass(frozen=True)
class AttentionSpec:
    num_heads: int
    num_kv_heads: int
    """Key/value heads (GQA: fewer than num_heads; query heads [j*g, (j+1)*g) share kv head j)."""
    head_dim: int
    qkv_bias: bool = True
    out_bias: bool = True
    dropout: float = 0.0
    """On the attention probabilities."""
    layer_types: tuple[str, ...] = ()
    """Each layer's type ("full_attention", "sliding_attention", ...), one per layer."""
    rope_theta: Mapping[str, float] = field(default_factory=dict)
    """RoPE base per layer type; empty: no RoPE (learned positions)."""
    half_window: Mapping[str, int] = field(default_factory=dict)
    """Per layer type: a token sees keys at most this many positions away; absent: global."""

    def __post_init__(self):
        _need(self.num_heads > 0 and self.num_kv_heads > 0 and self.head_dim > 0,
              "attention heads, key/value heads and head_dim must be positive")
        _need(self.num_heads % self.num_kv_heads == 0,
              f"{self.num_heads} attention heads do not group over {self.num_kv_heads} key/value heads")
        _need(0.0 <= self.dropout < 1.0, f"attention dropout must be in [0, 1), got {self.dropout}")
        types = set(self.layer_types)
        for name, table in (("rope_theta", self.rope_theta), ("half_window", self.half_window)):
            unknown = set(table) - types
            _need(not unknown, f"{name} names layer types {sorted(unknown)} that no layer has")
        _need(not self.rope_theta or set(self.rope_theta) == types,
              f"RoPE needs a base for every layer type {sorted(types)}, got {sorted(self.rope_theta)}")
        for t, w in self.half_window.items():
            _need(w >= 1, f"the {t} layers' window must be at least 1 token each side, got {w}")
        for t, theta in self.rope_theta.items():
            _need(theta > 0, f"the {t} layers' RoPE base must be positive, got {theta}")
        _need(not self.rope_theta or self.head_dim % 2 == 0, f"RoPE needs an even head_dim, got {self.head_dim}")

    @property
    def rope(self) -> bool:
        return bool(self.rope_theta)

    @property
    def gqa(self) -> bool:
        return self.num_kv_heads != self.num_heads

    def layer_type(self, layer: int) -> str:
        return self.layer_types[layer]

    def window(self, layer: int) -> Optional[int]:
        """Layer `layer`'s half window, or None: it attends globally."""
        return self.half_window.get(self.layer_types[layer])

    def theta(self, layer: int) -> Optional[float]:
        return self.rope_theta.get(self.layer_types[layer])


@dataclass(frozen=True)
class MLPSpec:
    ffn_size: int
    kind: str = "plain"
    """plain: down(act(up(x))); glu: down(act(input) * gate), one up-projection [input; gate]."""
    activation: str = "gelu"
    """transformers' ACT2FN name (gelu is exact erf)."""
    in_bias: bool = True
    out_bias: bool = True
    dropout: float = 0.0
    """Inside the MLP, after the activation (ModernBERT's mlp_dropout)."""
    gate_first: bool = False
    """glu: the up-projection's halves are [gate; input], the activated half second (GTE's
    up_gate_proj); False: [input; gate] (ModernBERT's Wi)."""

    def __post_init__(self):
        _need(self.ffn_size > 0, f"the MLP width must be positive, got {self.ffn_size}")
        _need(self.kind in MLP_KINDS, f"MLP kind must be one of {MLP_KINDS}, got {self.kind!r}")
        _need(self.activation in ACTIVATIONS, f"activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        _need(0.0 <= self.dropout < 1.0, f"MLP dropout must be in [0, 1), got {self.dropout}")


@dataclass(frozen=True)
class MLMHeadSpec:
    transform: bool = True
    """dense -> activation (-> norm) before the decoder; False: the decoder reads the hidden states."""
    width: int = 0
    """> 0: the transform is a bottleneck, dense (h -> width) -> activation -> dense (width -> h)
    -> activation (UltraBERT's prediction head); 0: one dense h -> h."""
    activation: str = "gelu"
    dense_bias: bool = True
    norm: bool = True
    tied: bool = True
    """Decoder weight = the word embeddings; False: a decoder matrix of its own."""
    decoder_bias: bool = True

    def __post_init__(self):
        _need(self.activation in ACTIVATIONS, f"MLM head activation must be one of {ACTIVATIONS}, got "
                                              f"{self.activation!r}")


@dataclass(frozen=True)
class ClassifierSpec:
    """How a sequence classifier reads the encoder (its pooling) and what sits before its linear."""

    pooling: str = "pooler"
    """pooler: tanh(dense([CLS])) (BERT's); cls: the [CLS] state; mean: the real tokens' mean;
    late: every token classified, the logits averaged over the real tokens (EuroBERT's)."""
    prediction_head: bool = False
    """dense -> activation (-> norm) before the classifier (ModernBERT's, EuroBERT's)."""
    head_norm: bool = True
    """The prediction head ends in a norm (ModernBERT's); False: dense -> activation (EuroBERT's)."""
    dense_bias: bool = True
    activation: str = "gelu"
    dropout: float = 0.0

    def __post_init__(self):
        _need(self.pooling in POOLINGS, f"classifier pooling must be one of {POOLINGS}, got {self.pooling!r}")


@dataclass(frozen=True)
class InitSpec:
    std: float = 0.02
    truncate_at: Optional[float] = None
    """Draw from a normal truncated at this many standard deviations; None: untruncated."""
    scaled_out: bool = False
    """Output projections (attention out, MLP down, MLM head dense) at std / sqrt(2 x layers)."""

    def __post_init__(self):
        _need(self.std > 0, f"the initialisation std must be positive, got {self.std}")


@dataclass(frozen=True)
class ModuleNames:
    """megabert's own names of the parts (its checkpoints' keys). Kept per family so that
    checkpoints written before the families shared one tree load as they are."""

    attention: str = "attention"
    qkv: str = "qkv"
    attn_out: str = "dense"
    mlp_in: str = "dense_h_to_4h"
    mlp_out: str = "dense_4h_to_h"
    attn_norm: str = "attention_layernorm"
    mlp_norm: str = "mlp_layernorm"
    final_norm: str = "final_layernorm"
    embedding_norm: str = "layernorm"
    head_norm: str = "layernorm"


@dataclass(frozen=True)
class EncoderSpec:
    """A whole encoder: sizes, the norm and its placement, and each part's spec."""

    family: str
    """The registry name (megabert.families), for messages and config.json; no code
    outside the registry branches on it."""
    hidden_size: int
    num_layers: int
    norm: NormSpec
    pre_norm: bool
    """Pre-LN with a final norm (ModernBERT, EuroBERT); False: post-LN (BERT, GTE, NomicBERT)."""
    embeddings: EmbeddingSpec
    attention: AttentionSpec
    mlp: MLPSpec
    mlm_head: MLMHeadSpec
    classifier: ClassifierSpec
    init: InitSpec
    residual_dropout: tuple[float, float] = (0.0, 0.0)
    """Dropout on the attention's and the MLP's output before each residual add."""
    first_layer_attn_norm: bool = True
    """Pre-LN: False when layer 0 reads the embedding norm's output as it is (ModernBERT)."""
    names: ModuleNames = ModuleNames()
    hf_layer_prefix: str = ""
    """transformers' prefix of layer i's tensors ("bert.encoder.layer.{i}.")."""
    hf_layer_names: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """Layer part (qkv, attn_out, attn_norm, mlp_in, mlp_out, mlp_norm) -> transformers' names
    after the layer prefix, without .weight/.bias; several: our tensor is theirs concatenated
    along dim 0."""
    hf_names: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """The other parts (word_embeddings, embedding_norm, final_norm, head_dense, ...) -> their
    full transformers names without the suffix. A part absent from both has no counterpart."""

    def __post_init__(self):
        _need(self.hidden_size > 0 and self.num_layers > 0, "hidden_size and num_layers must be positive")
        _need(len(self.attention.layer_types) == self.num_layers,
              f"{len(self.attention.layer_types)} layer types for {self.num_layers} layers")
        _need(self.pre_norm or self.first_layer_attn_norm, "a post-LN layer always has its attention norm")
        for p in self.residual_dropout:
            _need(0.0 <= p < 1.0, f"residual dropout must be in [0, 1), got {p}")

    def hf(self, part: str, suffixes: tuple[str, ...] = ("weight", "bias")) -> dict[str, tuple[str, ...]]:
        """{suffix: transformers' names} of a non-layer part ({} when it has none)."""
        templates = self.hf_names.get(part, ())
        return {k: tuple(f"{t}.{k}" for t in templates) for k in suffixes} if templates else {}

    def hf_layer(self, part: str, hf_prefix: str, suffixes: tuple[str, ...] = ("weight", "bias")
                 ) -> dict[str, tuple[str, ...]]:
        """{suffix: transformers' names} of layer part `part` under the layer's `hf_prefix`."""
        templates = self.hf_layer_names.get(part, ())
        return {k: tuple(f"{hf_prefix}{t}.{k}" for t in templates) for k in suffixes} if templates else {}
