"""What a family module declares: its Recipe and its Family record (megabert.families)."""
from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction
from typing import Callable, Mapping

from megabert.config import ModelConfig
from megabert.families.spec import EncoderSpec


@dataclass(frozen=True)
class Recipe:
    """How the family pre-trains from scratch."""

    mask_prob: float
    """The share of tokens masked (--mask-prob's default)."""
    binary_head: bool
    """A sentence-pair (NSP/SOP) head beside the masked LM."""
    tokenizer: str
    """wordpiece (vocab.txt) or tokenizer.json (a transformers fast tokenizer)."""


@dataclass(frozen=True)
class Family:
    name: str
    """--model-family NAME, ModelConfig.model_family."""
    model_type: str
    """config.json's model_type."""
    spec: Callable[[ModelConfig], EncoderSpec]
    config_from_hf: Callable[[dict], dict]
    """config.json -> ModelConfig fields (a CheckpointError names the field it cannot take)."""
    hf_config: Callable[[ModelConfig, str], dict]
    """(config, architecture) -> config.json."""
    recipe: Recipe
    scratch_defaults: Mapping[str, object] = field(default_factory=dict)
    """ModelConfig fields for --model-family NAME where a flag is left out."""
    ffn_per_hidden: Fraction = Fraction(4)
    """--ffn-hidden-size for --model-family NAME where it is left out, as a multiple of
    --hidden-size (rounded down)."""
    task_classes: Mapping[str, str] = field(default_factory=dict)
    """Task (pretraining, masked_lm, sequence_classification, token_classification,
    question_answering, embeddings) -> the model class name (megabert.model_classes)
    that runs it. masked_lm: megabert.AutoModelForMaskedLM's (EncoderForMaskedLM, every family)."""
    hf_prefix_aliases: Mapping[str, str] = field(default_factory=dict)
    """Tensor-name prefixes other writers of the family use -> transformers' ("new." -> "gte.")."""
    hf_base_prefix: str = ""
    """The base model's prefix in transformers' task checkpoints ("bert."): a bare base model
    (sentence-transformers' export) is saved without it."""
    packed_mlm_slots: bool = False
    """The pre-training model reads packed rows' masked positions as fixed [b, slots]
    (megabert.model.packed): the fixed-shape packed step that CUDA graphs need. False: its
    packed rows select them on the device."""
    architecture_from_checkpoint: bool = True
    """--load DIR takes the architecture from the checkpoint's config (False: from the flags, as
    Megatron-LM's BERT; the checkpoint must then match them)."""
    architectures: Mapping[str, str] = field(default_factory=dict)
    """Task -> the transformers architecture an export of it names (pretraining: the masked LM's)."""

    def ffn_size(self, hidden_size: int) -> int:
        """The MLP width a model of this family and `hidden_size` gets by default."""
        return int(self.ffn_per_hidden * hidden_size)


# transformers names a family's classes <Prefix><suffix>; its masked LM serves pre-training too.
_HF_SUFFIXES = {"pretraining": "ForMaskedLM", "masked_lm": "ForMaskedLM", "embeddings": "Model",
                "sequence_classification": "ForSequenceClassification",
                "token_classification": "ForTokenClassification", "question_answering": "ForQuestionAnswering"}


def hf_architectures(prefix: str, *heads: str, **named: str) -> dict[str, str]:
    """Family.architectures: transformers' masked LM and bare model of `prefix` ("EuroBert"), the
    task `heads` transformers defines for the family, and `named` ones that break the pattern."""
    return {**{t: prefix + _HF_SUFFIXES[t] for t in ("pretraining", "masked_lm", "embeddings", *heads)}, **named}


def encoder_task_classes(**own: str) -> dict[str, str]:
    """Family.task_classes of a family built on the spec's encoder: the shared task models, with the
    family's `own` where its head differs (EuroBERT's pooled classifier). A task transformers lacks
    (question answering for most families) still fine-tunes here; its export is refused."""
    return {"pretraining": "EncoderForMaskedLM", "masked_lm": "EncoderForMaskedLM",
            "sequence_classification": "BertForSequenceClassification",
            "token_classification": "BertForTokenClassification",
            "question_answering": "BertForQuestionAnswering", "embeddings": "BertForSentenceEmbedding", **own}
