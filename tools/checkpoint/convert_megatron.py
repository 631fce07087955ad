"""Megatron-LM / Megatron-DeepSpeed BERT checkpoints <-> megabert, at any tensor/pipeline layout.

    convert_megatron.py import --megatron-dir megatron_run/ --output ckpt/ [--tensor-model-parallel-size 2]
    convert_megatron.py export --load ckpt/ --megatron-dir out/ --format torch_dist [--tensor-model-parallel-size 2]

import reads a Megatron `--save` directory (the root with latest_checkpointed_iteration.txt, or one
iteration directory) in the `torch` format (legacy `language_model.*` names of any era and QKV
checkpoint_version, or megatron-core names; any saved TP/PP) or the `torch_dist` format; megatron is
never imported and nothing foreign is unpickled. export writes `torch_dist` (what megatron-core's
dist_checkpointing.load reads into its BertModel at any TP) or `torch` (megatron-core names at the
given TP/PP; `--legacy`: the legacy model's names, what transformers' convert_megatron_bert_checkpoint.py
reads), as `release/` unless --iteration is given. export writes the Adam state of the loaded run too
(megatron-core names: `torch` or `torch_dist`; not with --legacy), so Megatron-LM continues it; import
writes weights only (a megabert run continues a Megatron directory's moments from --load directly).
RNG state is not carried. export --load also takes a Megatron directory, so one Megatron layout or
format becomes another directly.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
from typing import Optional

from megabert.checkpoint import megatron
from megabert.checkpoint.layout import save_full_model
from megabert.checkpoint.megatron import writer
from megabert.checkpoint.megatron.adam_state import AdamExport
from megabert.checkpoint.reader import read_full, read_rank
from megabert.config import ModelConfig, ParallelConfig
from megabert.data import build_tokenizer
from megabert.errors import CheckpointError, ConfigError, cli_main
from megabert.model_classes import reference_table
from megabert.parallel.layout import StageLayout
from megabert.paths import DIR, FILE, OUT_DIR, check_paths
from megabert.rules import validate_layout


def import_megatron(megatron_dir: str, output: str, tp: int, pp: int, *, vocab_file: Optional[str] = None,
                    num_attention_heads: Optional[int] = None) -> str:
    if not megatron.is_megatron_dir(megatron_dir):
        raise CheckpointError(f"--megatron-dir {megatron_dir} is not a Megatron-LM checkpoint (no "
                              f"mp_rank_*/model_optim_rng.pt and no torch_dist .metadata under it or its "
                              f"latest_checkpointed_iteration.txt)")
    overrides = {"num_attention_heads": num_attention_heads}
    if vocab_file:
        overrides["vocab_size"] = build_tokenizer("BertWordPieceLowerCase", vocab_file).vocab_size
    cfg = megatron.read_config(megatron_dir, overrides)
    validate_layout(cfg, ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp), tp * pp)
    table = reference_table(cfg, "BertForPreTraining")
    full = {k: v for k, v in megatron.read_state(megatron_dir, cfg).items() if k in table}
    path = save_full_model(output, full, cfg, table, tp_size=tp, pp_size=pp, model_class="BertForPreTraining")
    beside = vocab_file or os.path.join(megatron_dir, "vocab.txt")
    if os.path.isfile(beside):  # export and --load find the tokenizer beside the checkpoint
        shutil.copyfile(beside, os.path.join(output, "vocab.txt"))
    return path


def export_megatron(load: str, megatron_dir: str, fmt: str, tp: int, pp: int, *, legacy: bool = False,
                    iteration: Optional[int] = None) -> str:
    full, meta, _ = read_full(load)
    cfg = ModelConfig(**meta["model_config"])
    validate_layout(cfg, ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp), tp * pp)
    if fmt == "torch_dist" and (pp != 1 or legacy):
        raise ConfigError("--format torch_dist stores global shapes that any layout reads: leave out "
                          "--pipeline-model-parallel-size and --legacy")
    canonical = writer.megabert_to_canonical(full, cfg, tp)
    adam, why_not = (None, "--legacy writes weights only") if legacy else _adam_export(load, cfg, tp)
    tag = "release" if iteration is None else iteration
    os.makedirs(megatron_dir, exist_ok=True)
    if fmt == "torch_dist":
        path = writer.write_torch_dist(megatron_dir, canonical, cfg, tp_size=tp, tag=tag, adam=adam)
    else:
        path = writer.write_torch(megatron_dir, canonical, cfg, tp_size=tp, pp_size=pp, tag=tag, legacy=legacy,
                                  adam=adam)
    print(f"optimizer state: {f'Adam moments at step {adam.step:g}' if adam else f'none ({why_not})'}")
    return path


def _adam_export(load: str, cfg: ModelConfig, tp: int) -> tuple[Optional[AdamExport], Optional[str]]:
    """The loaded run's Adam state for Megatron (AdamExport), or None and why not: a
    checkpoint without one (converted weights, DeepSpeed's, LAMB's) is exported as weights."""
    payload = read_rank(load, tp_rank=0, tp_size=1, stage=StageLayout(cfg.num_layers), optimizer=True).payload
    optim = (payload.get("args") or {}).get("optim") or {}  # a megabert run's flags (a Megatron run's: read as Adam)
    if optim.get("optimizer", "adam") != "adam" or optim.get("bias_correction") is False:
        why = "LAMB" if optim.get("optimizer") == "lamb" else "Adam without bias correction"
        return None, f"the run trained with {why}, whose state Megatron's AdamW does not continue"
    saved = payload.get("optimizer")
    if saved is None:
        return None, payload.get("optimizer_note") or "the checkpoint holds no optimizer state"
    params = set(payload["model"])
    if set(saved["state"]) != params or any(k not in s for s in saved["state"].values() for k in ("exp_avg", "step")):
        return None, "its optimizer state is not Adam's for every parameter (LAMB, or parameters never stepped)"
    moments = {kind: writer.megabert_to_canonical({n: s[kind] for n, s in saved["state"].items()}, cfg, tp)
               for kind in ("exp_avg", "exp_avg_sq")}
    group = (saved.get("param_groups") or [{}])[0]
    args = payload.get("megatron_args") or {}
    step = float(next(iter(saved["state"].values()))["step"])
    return AdamExport(moments, step, lr=float(group.get("lr", args.get("lr") or 0.0)),
                      betas=tuple(group.get("betas", (args.get("adam_beta1", 0.9), args.get("adam_beta2", 0.999)))),
                      eps=float(group.get("eps", args.get("adam_eps", 1e-8))),
                      weight_decay=float(group.get("weight_decay", args.get("weight_decay", 0.01)))), None


@cli_main
def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    imp = sub.add_parser("import", help="Megatron-LM directory -> megabert checkpoint")
    imp.add_argument("--megatron-dir", required=True)
    imp.add_argument("--output", required=True)
    imp.add_argument("--tensor-model-parallel-size", type=int, default=1)
    imp.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    imp.add_argument("--vocab-file", help="the WordPiece vocab.txt the model was trained with: cuts the vocab "
                     "padding when the checkpoint's args do not say the real size; copied beside the output")
    imp.add_argument("--num-attention-heads", type=int, help="needed only for a checkpoint without args")
    exp = sub.add_parser("export", help="megabert checkpoint -> Megatron-LM directory")
    exp.add_argument("--load", required=True)
    exp.add_argument("--megatron-dir", required=True)
    exp.add_argument("--format", choices=("torch_dist", "torch"), default="torch_dist")
    exp.add_argument("--tensor-model-parallel-size", type=int, default=1)
    exp.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    exp.add_argument("--legacy", action="store_true", help="--format torch with the legacy model's names "
                     "(language_model.*), as transformers' convert_megatron_bert_checkpoint.py reads them")
    exp.add_argument("--iteration", type=int, help="write iter_NNNNNNN/ instead of release/")
    args = p.parse_args(argv)
    if args.cmd == "import":
        check_paths([(args.megatron_dir, "--megatron-dir", DIR), (args.vocab_file, "--vocab-file", FILE),
                     (args.output, "--output", OUT_DIR)])
    else:
        check_paths([(args.load, "--load", DIR), (args.megatron_dir, "--megatron-dir", OUT_DIR)])
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if args.cmd == "import":
        path = import_megatron(args.megatron_dir, args.output, tp, pp, vocab_file=args.vocab_file,
                               num_attention_heads=args.num_attention_heads)
        print(f"wrote {path} (tp={tp}, pp={pp})")
    else:
        path = export_megatron(args.load, args.megatron_dir, args.format, tp, pp, legacy=args.legacy,
                               iteration=args.iteration)
        print(f"wrote {path} ({args.format}, tp={tp}, pp={pp})")


if __name__ == "__main__":
    sys.exit(main())
