"""Hugging Face (any family of megabert.families) <-> megabert checkpoint, at any tensor/pipeline layout;
Google's TensorFlow BERT -> megabert.

    convert_hf.py import --hf-dir bert-base-uncased/ --output ckpt/ --tensor-model-parallel-size 2
    convert_hf.py import --tf-checkpoint uncased_L-12_H-768_A-12/ --output ckpt/
    convert_hf.py export --load ckpt/ --hf-dir exported/ [--vocab-file vocab.txt]

The export writes weights, config.json and the tokenizer files (vocab.txt, tokenizer_config.json,
special_tokens_map.json) that transformers' AutoTokenizer and pipeline() load as they stand; a
tokenizer.json family's tokenizer.json (and tokenizer_config.json, special_tokens_map.json) is copied from
--vocab-file's directory, the run's, or beside the checkpoint.

Runs in one process without a process group: shards are cut as the parameters' specs
say (a shape-only model of the class gives the table), not by building the model on
every rank.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
from typing import Optional

from megabert.checkpoint import hf as hf_io
from megabert.checkpoint import tf as tf_io
from megabert.checkpoint.hf_tokenizer import TOKENIZER_FILES, WORDPIECE_TYPES, export_tokenizer
from megabert.checkpoint.layout import save_full_model
from megabert.checkpoint.reader import read_full
from megabert.model_classes import by_name, meta_model, reference_table
from megabert.config import ModelConfig, ParallelConfig
from megabert.rules import validate_layout
from megabert.errors import CheckpointError, cli_main
from megabert.families import get_family, model_class_for_architectures
from megabert.paths import DIR, FILE_OR_DIR, OUT_DIR, check_paths


def read_source(hf_dir: Optional[str], tf_checkpoint: Optional[str]) -> tuple[dict, dict, str]:
    """(HF config dict, HF-named state dict, directory whose tokenizer files to keep) of
    --hf-dir or --tf-checkpoint: a TF checkpoint is read into Hugging Face names first."""
    if tf_checkpoint is not None:
        if not tf_io.is_tf_dir(tf_checkpoint):
            raise CheckpointError(f"--tf-checkpoint {tf_checkpoint} is not a Google BERT directory "
                                  f"(bert_config.json + bert_model.ckpt.index/.data-*) or checkpoint prefix")
        config, state = tf_io.read_tf_as_hf(tf_checkpoint)
        return config, state, tf_checkpoint if os.path.isdir(tf_checkpoint) else os.path.dirname(tf_checkpoint)
    if not hf_io.is_hf_dir(hf_dir):
        raise CheckpointError(f"--hf-dir {hf_dir} is not a Hugging Face BERT directory "
                              f"(config.json + model.safetensors or pytorch_model.bin)")
    return hf_io.read_hf_config(hf_dir), hf_io.read_hf_state(hf_dir), hf_dir


def import_checkpoint(output: str, tp: int, pp: int, *, hf_dir: Optional[str] = None,
                      tf_checkpoint: Optional[str] = None) -> str:
    """A transformers dir of any family (megabert.families, by config.json's model_type) or a
    TF BERT -> a checkpoint of the family's masked LM, or of the task model its architectures
    name (a fine-tuned head comes along), its tokenizer files beside it."""
    hf_config, hf_state, source_dir = read_source(hf_dir, tf_checkpoint)
    has_binary_head = any(k.startswith("cls.seq_relationship") for k in hf_state)
    cfg = hf_io.model_config_from_hf(hf_config, os.path.join(source_dir, "config.json"),
                                     bert_binary_head=has_binary_head)
    family = get_family(cfg.model_family)
    validate_layout(cfg, ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp), tp * pp)
    model_class = model_class_for_architectures(family, hf_config.get("architectures"),
                                                os.path.join(source_dir, "config.json"))
    table = reference_table(cfg, model_class)
    full = hf_io.hf_to_megabert(hf_state, table, family.hf_prefix_aliases, family.hf_base_prefix)
    missing = sorted(set(table) - set(full))
    if missing and family.architecture_from_checkpoint:
        raise CheckpointError(f"{source_dir} lacks tensors a {model_class} needs (first: "
                              f"{table[missing[0]].hf_names}); is it a {family.name} checkpoint of that kind?")
    check_shapes(full, table, cfg, model_class, source_dir)
    path = save_full_model(output, full, cfg, table, tp_size=tp, pp_size=pp, model_class=model_class)
    # The tokenizer travels with the weights: export and --load find it beside the checkpoint.
    _copy_files(source_dir, output, TOKENIZER_JSON_FILES if family.recipe.tokenizer == "tokenizer.json"
                else ("vocab.txt", "tokenizer_config.json"))
    return path


def check_shapes(full: dict, table: dict, cfg: ModelConfig, model_class: str, source_dir: str) -> None:
    """Every tensor has the shape the model of `cfg` gives it, as --load checks (vocab rows as
    config.json counts them: loading pads them), so no checkpoint is written that --load refuses."""
    expected = dict(meta_model(by_name(model_class), cfg).state_dict())
    for name, tensor in full.items():
        want = tuple(expected[name].shape)
        if table[name].valid_rows is not None:
            want = (table[name].valid_rows, *want[1:])
        if tuple(tensor.shape) != want:
            raise CheckpointError(f"{source_dir}: {'+'.join(table[name].hf_names)} has shape {tuple(tensor.shape)} "
                                  f"but config.json's sizes give {want}: the weights and config.json disagree "
                                  f"(a damaged or mismatched checkpoint)")


# What transformers' AutoTokenizer reads from a tokenizer.json family's dir (tokenizer.json holds the model).
TOKENIZER_JSON_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def _copy_files(source: str, target: str, names) -> list[str]:
    copied = []
    for name in names:
        if os.path.isfile(os.path.join(source, name)):
            shutil.copyfile(os.path.join(source, name), os.path.join(target, name))
            os.chmod(os.path.join(target, name), 0o644)
            copied.append(name)
    return copied


def _trained_vocab_file(meta: dict) -> str:
    """The --vocab-file the checkpoint's run read ("" when it names none)."""
    args = meta.get("args") or {}
    trained = args.get("data") or args.get("finetune") or {}  # pre-training's flags, or fine-tuning's
    return trained.get("vocab_file") or ""


def _tokenizer_json_dir(load: str, meta: dict, vocab_file: Optional[str]) -> str:
    """Where the export's tokenizer.json comes from: --vocab-file (the file or its
    directory), else the one the run was trained with, else the one beside the checkpoint."""
    for candidate in (vocab_file, _trained_vocab_file(meta), load):
        if not candidate:
            continue
        directory = candidate if os.path.isdir(candidate) else os.path.dirname(candidate)
        if os.path.isfile(os.path.join(directory, "tokenizer.json")):
            return directory
    raise CheckpointError(f"no tokenizer.json to export with {load}: pass --vocab-file PATH/tokenizer.json (the "
                          f"tokenizer the model was trained with)")


def export_hf(load: str, hf_dir: str, vocab_file: Optional[str] = None, tokenizer_type: Optional[str] = None
              ) -> list[str]:
    """Writes the Hugging Face dir; returns the names of the files it wrote."""
    full, meta, table = read_full(load)
    cfg = ModelConfig(**meta["model_config"])
    family = get_family(cfg.model_family)
    # The run's tokenizer travels: a tokenizer.json (any family's: NomicBERT's may be one) or WordPiece.
    if family.recipe.tokenizer == "tokenizer.json" or _trained_vocab_file(meta).endswith(".json"):
        arch = hf_io.hf_architecture(cfg, meta.get("model_class", family.task_classes["pretraining"]))
        hf_io.write_hf_dir(hf_dir, hf_io.megabert_to_hf(full, table), hf_io.hf_config_from_model(cfg, arch))
        copied = _copy_files(_tokenizer_json_dir(load, meta, vocab_file), hf_dir, TOKENIZER_JSON_FILES)
        return ["model.safetensors", "config.json", *copied]
    arch = hf_io.hf_architecture(cfg, meta.get("model_class", family.task_classes["pretraining"]))
    vocab, lower_case = export_tokenizer(load, meta, vocab_file, tokenizer_type)
    hf_io.write_hf_dir(hf_dir, hf_io.megabert_to_hf(full, table), hf_io.hf_config_from_model(cfg, arch), vocab,
                       lower_case=lower_case)
    return ["model.safetensors", "config.json", *TOKENIZER_FILES]


@cli_main
def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    imp = sub.add_parser("import", help="Hugging Face dir -> megabert checkpoint")
    source = imp.add_mutually_exclusive_group(required=True)
    source.add_argument("--hf-dir", help="Hugging Face BERT dir (config.json + safetensors or pytorch_model.bin)")
    source.add_argument("--tf-checkpoint", help="Google TF BERT dir (bert_config.json, bert_model.ckpt.index/"
                        ".data-*, vocab.txt) or a checkpoint prefix in one")
    imp.add_argument("--output", required=True)
    imp.add_argument("--tensor-model-parallel-size", type=int, default=1)
    imp.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    exp = sub.add_parser("export", help="megabert checkpoint -> Hugging Face dir (safetensors, config.json, "
                         "tokenizer files)")
    exp.add_argument("--load", required=True)
    exp.add_argument("--hf-dir", required=True)
    exp.add_argument("--vocab-file", help="WordPiece vocab.txt; default: the one the checkpoint was trained with, "
                     "else vocab.txt beside it")
    exp.add_argument("--tokenizer-type", choices=sorted(WORDPIECE_TYPES),
                     help="casing of the exported tokenizer; default: the one the checkpoint was trained with")
    args = p.parse_args(argv)
    if args.cmd == "import":  # a TF checkpoint may be named by its prefix: tf.is_tf_dir checks it
        check_paths([(args.hf_dir, "--hf-dir", DIR), (args.output, "--output", OUT_DIR)])
    else:
        check_paths([(args.load, "--load", DIR), (args.vocab_file, "--vocab-file", FILE_OR_DIR),
                     (args.hf_dir, "--hf-dir", OUT_DIR)])
    if args.cmd == "import":
        path = import_checkpoint(args.output, args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                                 hf_dir=args.hf_dir, tf_checkpoint=args.tf_checkpoint)
        print(f"wrote {path} (tp={args.tensor_model_parallel_size}, pp={args.pipeline_model_parallel_size})")
    else:
        written = export_hf(args.load, args.hf_dir, args.vocab_file, args.tokenizer_type)
        print(f"wrote {args.hf_dir}: {', '.join(written)}")


if __name__ == "__main__":
    sys.exit(main())
