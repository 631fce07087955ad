"""The ModelConfig of a Megatron BERT checkpoint: from its `args` when it has them, else from
its tensor shapes plus the flags the user gave.

Megatron builds BERT pre-LN with a final LayerNorm, no LayerNorm after the embeddings,
LayerNorm epsilon 1e-5 (its default), exact GELU, learned absolute positions, and the LM head
dense -> GELU -> LayerNorm -> tied projection + bias; megabert builds the same with
`layernorm_position="pre"` and `embedding_layernorm=False`. Architectures megabert does not
build (RMSNorm, SwiGLU, grouped-query attention, rotary positions, untied output) stop here
in one line.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from megabert.config import ModelConfig
from megabert.errors import CheckpointError

# ModelConfig field -> Megatron args name, for the fields that define the architecture.
_ARCH_ARGS = {"num_layers": "num_layers", "hidden_size": "hidden_size", "num_attention_heads": "num_attention_heads",
              "ffn_hidden_size": "ffn_hidden_size", "max_position_embeddings": "max_position_embeddings"}
_OTHER_ARGS = {"layernorm_epsilon": "layernorm_epsilon", "hidden_dropout": "hidden_dropout",
               "attention_dropout": "attention_dropout", "init_method_std": "init_method_std",
               "make_vocab_size_divisible_by": "make_vocab_size_divisible_by"}
# args that describe an architecture megabert does not build: (name, the value it must have, what it means)
_UNSUPPORTED = [("normalization", "LayerNorm", "RMSNorm"), ("swiglu", False, "SwiGLU MLPs"),
                ("group_query_attention", False, "grouped-query attention"),
                ("position_embedding_type", "learned_absolute", "rotary/relative positions"),
                ("add_bias_linear", True, "linear layers without biases"),
                ("untie_embeddings_and_output_weights", False, "an output layer untied from the word embeddings"),
                ("apply_residual_connection_post_layernorm", False, "residuals taken after the LayerNorm"),
                ("openai_gelu", False, "the tanh GELU approximation")]


def _flag(field: str) -> str:
    return "--" + field.replace("_", "-")


def model_config(path: str, args: dict, shapes: dict[str, tuple], overrides: dict) -> ModelConfig:
    """`shapes`: canonical name -> full shape (vocab rows as saved). `overrides`: ModelConfig
    fields from flags or from_pretrained keywords; an architecture field that disagrees with
    the checkpoint is an error naming both."""
    for name, expected, what in _UNSUPPORTED:
        if args.get(name) is not None and args[name] != expected:
            raise CheckpointError(f"{path} was trained with {name}={args[name]!r} ({what}); megabert's BERT "
                                  f"builds {name}={expected!r} only")
    word = shapes.get("embedding.word_embeddings.weight")
    if word is None:
        raise CheckpointError(f"{path} holds no word embeddings (embedding.word_embeddings.weight or "
                              f"language_model.embedding.word_embeddings.weight): not a Megatron BERT checkpoint")
    from_shapes = {"hidden_size": word[1],
                   "num_layers": len({k.split(".")[2] for k in shapes if k.startswith("encoder.layers.")}),
                   "ffn_hidden_size": shapes["encoder.layers.0.mlp.linear_fc1.weight"][0],
                   "max_position_embeddings": shapes["embedding.position_embeddings.weight"][0]}
    fields: dict = {}
    for field, arg in {**_ARCH_ARGS, **_OTHER_ARGS}.items():
        if args.get(arg) is not None:
            fields[field] = args[arg]
    for field, value in from_shapes.items():
        if field in fields and fields[field] != value:
            raise CheckpointError(f"{path}: args say {arg_name(field)}={fields[field]} but its tensors have "
                                  f"{value}; the checkpoint is inconsistent")
        fields[field] = value
    for field in _ARCH_ARGS:
        if (field in overrides and overrides[field] is not None and field in fields
                and overrides[field] != fields[field]):
            raise CheckpointError(f"{_flag(field)} {overrides[field]} disagrees with {path}, which has "
                                  f"{field}={fields[field]}: drop the flag or load a checkpoint of that size")
    if "num_attention_heads" not in fields:
        if overrides.get("num_attention_heads") is None:
            raise CheckpointError(f"{path} has no args to say its number of attention heads (tensor shapes do not): "
                                  f"pass --num-attention-heads")
        fields["num_attention_heads"] = overrides["num_attention_heads"]
    padded = word[0]
    vocab = overrides.get("vocab_size") or args.get("vocab_size") or padded
    if vocab > padded:
        raise CheckpointError(f"a vocab of {vocab} ids does not fit {path}, whose word embeddings have {padded} "
                              f"rows: pass the vocab the model was trained with")
    fields.update(vocab_size=vocab, layernorm_position="pre", embedding_layernorm=False,
                  layernorm_epsilon=fields.get("layernorm_epsilon", 1e-5),
                  type_vocab_size=shapes.get("embedding.tokentype_embeddings.weight", (2,))[0],
                  bert_binary_head="binary_head.weight" in shapes)
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    rest = {k: v for k, v in overrides.items() if k in known and k not in fields and v is not None}
    return ModelConfig(**{**fields, **rest})


def arg_name(field: str) -> str:
    return {**_ARCH_ARGS, **_OTHER_ARGS}.get(field, field)


def vocab_note(cfg: ModelConfig, padded: int, args: dict, override: Optional[int]) -> Optional[str]:
    """A warning when the real vocab size is unknown and the padding rows are kept."""
    if override or args.get("vocab_size"):
        return None
    return (f"the checkpoint does not say its real vocab size: all {padded} rows of its (padded) word embeddings "
            f"are kept; pass --vocab-file (or vocab_size=) to cut the padding")
