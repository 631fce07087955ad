"""Hugging Face BERT <-> megabert checkpoint, at any tensor/pipeline layout.

    convert_hf.py import --hf-dir bert-base-uncased/ --output ckpt/ --tensor-model-parallel-size 2
    convert_hf.py export --load ckpt/ --hf-dir exported/

Runs in one process without a process group: shards are cut as the parameters' specs
say (a shape-only model of the class gives the table), not by building the model on
every rank.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys

from megabert.checkpoint import hf as hf_io
from megabert.checkpoint.layout import load_full_model, save_full_model
from megabert.checkpoint.sharding import reference_table
from megabert.config import ModelConfig, ParallelConfig, validate_layout
from megabert.errors import CheckpointError, cli_main


def import_hf(hf_dir: str, output: str, tp: int, pp: int) -> str:
    if not hf_io.is_hf_dir(hf_dir):
        raise CheckpointError(f"--hf-dir {hf_dir} is not a Hugging Face BERT directory "
                              f"(config.json + model.safetensors or pytorch_model.bin)")
    hf_config = hf_io.read_hf_config(hf_dir)
    hf_state = hf_io.read_hf_state(hf_dir)
    arch = (hf_config.get("architectures") or ["BertForPreTraining"])[0]
    model_class = "BertForQuestionAnswering" if arch == "BertForQuestionAnswering" else "BertForPreTraining"
    has_binary_head = any(k.startswith("cls.seq_relationship") for k in hf_state)
    cfg = hf_io.model_config_from_hf(hf_config, bert_binary_head=has_binary_head)
    validate_layout(cfg, ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp), tp * pp)
    table = reference_table(cfg, model_class)
    full = hf_io.hf_to_megabert(hf_state, table)
    path = save_full_model(output, full, cfg, table, tp_size=tp, pp_size=pp, model_class=model_class)
    vocab = os.path.join(hf_dir, "vocab.txt")
    if os.path.isfile(vocab):
        shutil.copyfile(vocab, os.path.join(output, "vocab.txt"))
    return path


def export_hf(load: str, hf_dir: str) -> None:
    full, meta, table = load_full_model(load)
    cfg = ModelConfig(**meta["model_config"])
    arch = meta.get("model_class", "BertForPreTraining")
    if arch == "BertForPreTraining" and not cfg.bert_binary_head:
        arch = "BertForMaskedLM"
    vocab = os.path.join(load, "vocab.txt")
    hf_io.write_hf_dir(hf_dir, hf_io.megabert_to_hf(full, table), hf_io.hf_config_from_model(cfg, arch),
                       vocab if os.path.isfile(vocab) else None)


@cli_main
def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    imp = sub.add_parser("import", help="Hugging Face dir -> megabert checkpoint")
    imp.add_argument("--hf-dir", required=True)
    imp.add_argument("--output", required=True)
    imp.add_argument("--tensor-model-parallel-size", type=int, default=1)
    imp.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    exp = sub.add_parser("export", help="megabert checkpoint -> Hugging Face dir (safetensors + config.json)")
    exp.add_argument("--load", required=True)
    exp.add_argument("--hf-dir", required=True)
    args = p.parse_args(argv)
    if args.cmd == "import":
        path = import_hf(args.hf_dir, args.output, args.tensor_model_parallel_size, args.pipeline_model_parallel_size)
        print(f"wrote {path} (tp={args.tensor_model_parallel_size}, pp={args.pipeline_model_parallel_size})")
    else:
        export_hf(args.load, args.hf_dir)
        print(f"wrote {args.hf_dir}/model.safetensors and config.json")


if __name__ == "__main__":
    sys.exit(main())
