"""Google's TensorFlow BERT checkpoints (as released with BERT) -> Hugging Face names.

A Google BERT directory holds `bert_config.json`, `vocab.txt` and a checkpoint prefix
(`bert_model.ckpt.index` + `.data-00000-of-00001`; a run_squad.py / run_pretraining.py
output dir names its latest `model.ckpt-STEP` in a `checkpoint` state file). We turn it into
what a Hugging Face directory gives (config dict, state dict in BertForPreTraining /
BertForQuestionAnswering names), so `hf.model_config_from_hf` and `hf.hf_to_megabert`
then apply unchanged and there is one conversion path to keep right, not two.
TensorFlow is not needed: `tf_bundle` reads the files.

NOTE: Google's modeling.py computes GELU with the tanh approximation while its config says
"gelu"; like transformers' own TF converter, we keep "gelu" (exact erf). The two differ by
under 1e-3 per activation; fine-tuning absorbs it.
"""
from __future__ import annotations

import json
import logging
import os
import re
from typing import Optional

import torch

from megabert.checkpoint import tf_bundle
from megabert.errors import CheckpointError

logger = logging.getLogger(__name__)

CONFIG_FILE = "bert_config.json"
_STATE_FILE = "checkpoint"  # tf.train.Saver's pointer to the latest prefix of a directory
_DEFAULT_PREFIX = "bert_model.ckpt"  # the name in every checkpoint Google released

# Whole-name mappings that the per-component rules below cannot express.
_SPECIAL = {
    "cls/predictions/output_bias": "cls.predictions.bias",
    "cls/seq_relationship/output_weights": "cls.seq_relationship.weight",  # [2, hidden] already
    "cls/seq_relationship/output_bias": "cls.seq_relationship.bias",
    "cls/squad/output_weights": "qa_outputs.weight",  # run_squad.py: [2, hidden], start then end
    "cls/squad/output_bias": "qa_outputs.bias",
    # run_classifier.py (GLUE): top-level variables, [num_labels, hidden] already.
    "output_weights": "classifier.weight",
    "output_bias": "classifier.bias",
}
_OPTIMIZER_SLOTS = ("adam_m", "adam_v")  # AdamWeightDecayOptimizer's PARAM/adam_m, PARAM/adam_v
_TRAINING_STATE = ("global_step",)
_LEAVES = {"kernel": "weight", "bias": "bias", "gamma": "weight", "beta": "bias"}
_EMBEDDINGS = ("word_embeddings", "position_embeddings", "token_type_embeddings")


# ---------------------------------------------------------------- finding the files

def _prefix_and_dir(path: str) -> tuple[Optional[str], str]:
    """(checkpoint prefix or None, directory holding bert_config.json). `path` is a
    directory or a prefix (what Google's scripts take as --init_checkpoint)."""
    if os.path.isfile(path + ".index"):
        return path, os.path.dirname(path) or "."
    if not os.path.isdir(path):
        return None, path
    state = os.path.join(path, _STATE_FILE)
    if os.path.isfile(state):
        with open(state) as f:
            m = re.search(r'^model_checkpoint_path:\s*"(.*)"', f.read(), re.M)
        if m:
            # Saver may record an absolute path of the machine (or bucket) that trained it; a
            # copied directory still holds the files under the same base name.
            for prefix in (os.path.join(path, m.group(1)), os.path.join(path, os.path.basename(m.group(1)))):
                if os.path.isfile(prefix + ".index"):
                    return prefix, path
    default = os.path.join(path, _DEFAULT_PREFIX)
    if os.path.isfile(default + ".index"):
        return default, path
    indexes = sorted(n[: -len(".index")] for n in os.listdir(path) if n.endswith(".index"))
    if len(indexes) == 1:
        return os.path.join(path, indexes[0]), path
    if indexes:
        raise CheckpointError(f"{path} holds several TensorFlow checkpoints ({', '.join(indexes)}) and no "
                              f"'{_STATE_FILE}' file naming the latest; pass the prefix, e.g. "
                              f"{os.path.join(path, indexes[-1])}")
    return None, path


def is_tf_dir(path: str) -> bool:
    """A Google BERT directory (bert_config.json + a checkpoint's .index), or a checkpoint
    prefix in one. Never raises: callers use it to choose a reader."""
    try:
        prefix, directory = _prefix_and_dir(path)
    except (CheckpointError, OSError):
        return os.path.isfile(os.path.join(path, CONFIG_FILE))
    return prefix is not None and os.path.isfile(os.path.join(directory, CONFIG_FILE))


def _resolve(path: str) -> tuple[str, str]:
    prefix, directory = _prefix_and_dir(path)
    if prefix is None:
        raise CheckpointError(f"{path} holds no TensorFlow checkpoint (no *.index file); a Google BERT "
                              f"directory has bert_model.ckpt.index, bert_model.ckpt.data-*, {CONFIG_FILE} "
                              f"and vocab.txt")
    return prefix, directory


# ---------------------------------------------------------------- reading

def read_tf_variables(path: str, names: Optional[list] = None) -> dict[str, torch.Tensor]:
    """{TF variable name: tensor} of a checkpoint directory or prefix, names as stored
    (optimizer slots and global_step included). `names` limits what is read from disk."""
    prefix, _ = _resolve(path)
    num_shards, entries = tf_bundle.read_index(prefix + ".index")
    if names is not None:
        missing = [n for n in names if n not in entries]
        if missing:
            raise CheckpointError(f"{prefix}.index has no variable {missing[0]!r} "
                                  f"({len(missing)} of the {len(names)} requested are missing)")
        entries = {n: entries[n] for n in names}
    return tf_bundle.read_tensors(prefix, num_shards, list(entries.values()))


def read_tf_config(path: str) -> dict:
    """bert_config.json as a Hugging Face config dict (the keys are the same; model_type,
    layer_norm_eps and the architecture are added)."""
    _, directory = _resolve(path)
    config_path = os.path.join(directory, CONFIG_FILE)
    if not os.path.isfile(config_path):
        raise CheckpointError(f"{config_path} is missing: a Google BERT directory needs it beside the checkpoint "
                              f"(copy it from the model you fine-tuned from)")
    try:
        with open(config_path) as f:
            config = json.load(f)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{config_path} is not valid JSON ({e})") from e
    # Google's BERT hard-codes LayerNorm epsilon 1e-12 (modeling.py's layer_norm).
    return {"model_type": "bert", "layer_norm_eps": 1e-12, **config}


def hf_name(tf_name: str) -> Optional[tuple[str, bool]]:
    """(Hugging Face name, transpose?) of a Google BERT variable, or None for a variable that
    is not a model weight (optimizer slots, global_step, anything unknown)."""
    if tf_name in _SPECIAL:
        return _SPECIAL[tf_name], False
    parts = tf_name.split("/")
    if parts[0] not in ("bert", "cls") or parts[-1] in _OPTIMIZER_SLOTS:
        return None
    if parts[:2] == ["bert", "embeddings"] and len(parts) == 3 and parts[2] in _EMBEDDINGS:
        return f"bert.embeddings.{parts[2]}.weight", False
    if parts[-1] not in _LEAVES or (parts[0] == "cls" and parts[1:3] != ["predictions", "transform"]):
        return None
    out = []
    for p in parts[:-1]:
        m = re.fullmatch(r"layer_(\d+)", p)
        out += ["layer", m.group(1)] if m else [p]
    # TF dense kernels are [in, out]; torch Linear weights are [out, in].
    return ".".join(out + [_LEAVES[parts[-1]]]), parts[-1] == "kernel"


def read_tf_as_hf(path: str) -> tuple[dict, dict]:
    """(Hugging Face config dict, state dict in BertForPreTraining / BertForQuestionAnswering /
    BertForSequenceClassification names) of a Google BERT directory, so it loads exactly like a Hugging Face directory."""
    prefix, _ = _resolve(path)
    config = read_tf_config(path)
    _, entries = tf_bundle.read_index(prefix + ".index")
    mapped = {n: m for n in entries if (m := hf_name(n)) is not None}
    _log_skipped(prefix, [n for n in entries if n not in mapped])
    tensors = read_tf_variables(prefix, sorted(mapped))
    state = {}
    for tf_name, (name, transpose) in mapped.items():
        t = tensors[tf_name]
        state[name] = t.t().contiguous() if transpose else t
    words = state.get("bert.embeddings.word_embeddings.weight")
    if words is None:
        raise CheckpointError(f"{prefix}.index has no bert/embeddings/word_embeddings: not a Google BERT checkpoint")
    if "vocab_size" in config and words.size(0) != config["vocab_size"]:
        raise CheckpointError(f"{CONFIG_FILE} says vocab_size {config['vocab_size']} but {prefix} has "
                              f"{words.size(0)} word embeddings; the config and checkpoint do not belong together")
    config.setdefault("architectures", [_architecture(state)])
    if "classifier.weight" in state:
        config.setdefault("num_labels", state["classifier.weight"].size(0))
    return config, state


def _architecture(state: dict) -> str:
    """The transformers class of a Google checkpoint's heads: run_squad.py's span head,
    run_classifier.py's classifier, else pre-training's."""
    if "qa_outputs.weight" in state:
        return "BertForQuestionAnswering"
    if "classifier.weight" in state:
        return "BertForSequenceClassification"
    return "BertForPreTraining"


def _log_skipped(prefix: str, skipped: list) -> None:
    slots = [n for n in skipped if n.rsplit("/", 1)[-1] in _OPTIMIZER_SLOTS]
    other = [n for n in skipped if n not in slots and n not in _TRAINING_STATE]
    if slots:
        logger.info("%s: skipped %d optimizer slots (adam_m/adam_v); training restarts its optimizer",
                    prefix, len(slots))
    if other:
        logger.warning("%s: skipped %d variables that are not BERT weights: %s", prefix, len(other),
                       ", ".join(other[:10]) + (" ..." if len(other) > 10 else ""))
