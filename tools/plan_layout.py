"""Predict per-rank memory and per-step communication of BERT and ModernBERT training layouts.

One layout: its memory breakdown, its traffic, and whether it fits a budget.

    python tools/plan_layout.py --preset bert-large --tensor-model-parallel-size 2 --memory-gb 16

Every layout of N devices that fits a per-device budget, least communication first:

    python tools/plan_layout.py --preset bert-large --devices 8 --memory-gb 80 --global-batch-size 1024 --bf16

Given the machines (--tflops sustained per device, the links within and between nodes),
each layout also gets its predicted step time, the data-parallel reduction overlapped with
backward, and the list is ranked by it:

    python tools/plan_layout.py --preset bert-large --devices 64 --memory-gb 80 --global-batch-size 4096 \
        --bf16 --tflops 150 --gpus-per-node 8 --intra-node-gbit 2400 --inter-node-gbit 200

ModernBERT at its full context (--preset modernbert-base or modernbert-large; 30% of the tokens
predicted, as pretrain_bert.py --model-family modernbert):

    python tools/plan_layout.py --preset modernbert-large --seq-length 8192 --micro-batch-size 1 --bf16 \
        --tensor-model-parallel-size 2 --data-parallel-size 4 --global-batch-size 64

All figures are predictions (megabert.planning); bench/memory.py sets them against
measured peaks on the CPU.
"""
from __future__ import annotations

import argparse
import sys


from megabert.arguments import PRETRAIN_DEFAULTS
from megabert.config import DataConfig, ModelConfig, TrainConfig
from megabert.presets import PRESETS
from megabert.errors import ConfigError, cli_main
from megabert.families import recipe
from megabert.planning import Layout, Workload, communication, estimate, fit_warning, plan
from megabert.planning.params import total_params
from megabert.planning.step_time import Links, StepTime, compute_time, step_time


def _default(config_class, name: str):
    return config_class.__dataclass_fields__[name].default


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    m = p.add_argument_group("model (a preset, or the flags of pretrain_bert.py)")
    m.add_argument("--preset", choices=sorted(PRESETS), help=", ".join(sorted(PRESETS)))
    m.add_argument("--num-layers", type=int)
    m.add_argument("--hidden-size", type=int)
    m.add_argument("--num-attention-heads", type=int)
    m.add_argument("--ffn-hidden-size", type=int)
    m.add_argument("--vocab-size", type=int, help="before padding (default 30522)")
    m.add_argument("--max-position-embeddings", type=int)
    r = p.add_argument_group("run")
    # pretrain_bert.py's defaults, so a plan and the trainer's preflight describe the same run.
    r.add_argument("--seq-length", type=int, default=_default(DataConfig, "seq_length"),
                   help="default: pretrain_bert.py's, %(default)s")
    r.add_argument("--micro-batch-size", type=int, default=_default(TrainConfig, "micro_batch_size"),
                   help="default: pretrain_bert.py's, %(default)s")
    r.add_argument("--global-batch-size", type=int, help="default micro-batch x DP (no accumulation)")
    prec = r.add_mutually_exclusive_group()
    prec.add_argument("--bf16", action="store_true")
    prec.add_argument("--fp16", action="store_true")
    r.add_argument("--mask-prob", type=float, help="share of tokens the MLM head predicts (default: the family's recipe: "
                   "BERT 0.15, ModernBERT 0.3, ...)")
    r.add_argument("--recompute-granularity", default="none", help="none, selective or full")
    r.add_argument("--device", default="cuda", help="cuda (GPU memory) or cpu (process RSS)")
    r.add_argument("--overhead-gb", type=float, help="fixed per-process overhead (default: calibrated per device)")
    r.add_argument("--no-overlap-grad-reduce", dest="overlap_grad_reduce", action="store_false",
                   help="the DP reduction after backward, as pretrain_bert.py's flag (default: overlapped)")
    r.add_argument("--no-overlap-param-gather", dest="overlap_param_gather", action="store_false",
                   help="with --use-distributed-optimizer: parameters all-gathered after the step, not in forward")
    lay = p.add_argument_group("one layout (without --devices)")
    lay.add_argument("--tensor-model-parallel-size", type=int, default=1)
    lay.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    lay.add_argument("--num-layers-per-virtual-pipeline-stage", type=int)
    lay.add_argument("--decoder-first-pipeline-num-layers", type=int,
                     help="layers of the first pipeline stage (uneven stages; the others share the rest evenly)")
    lay.add_argument("--decoder-last-pipeline-num-layers", type=int,
                     help="layers of the last pipeline stage (uneven stages; the others share the rest evenly)")
    lay.add_argument("--data-parallel-size", type=int, default=1)
    lay.add_argument("--sequence-parallel", action="store_true")
    lay.add_argument("--zero-stage", type=int, default=0, help="0: megabert's trainer; 1-3: DeepSpeed ZeRO")
    lay.add_argument("--use-distributed-optimizer", action="store_true",
                     help="megabert's trainer with the optimizer states sharded over DP (zero-stage 0)")
    lay.add_argument("--zero-offload-optimizer", choices=("none", "cpu"), default="none")
    lay.add_argument("--zero-offload-params", choices=("none", "cpu"), default="none")
    t = p.add_argument_group("step time (with --tflops)")
    t.add_argument("--tflops", type=float, help="sustained TFLOP/s of one device on this model (e.g. 150 for an "
                   "A100 in bf16 at half its peak); predicts step times and ranks layouts by them")
    t.add_argument("--gpus-per-node", type=int, default=8, help="consecutive ranks per node (default %(default)s)")
    t.add_argument("--intra-node-gbit", type=float, default=2400.0,
                   help="Gbit/s from a device to one of its node (default %(default)g: A100 NVLink)")
    t.add_argument("--inter-node-gbit", type=float, default=200.0,
                   help="Gbit/s from a device to another node (default %(default)g: one HDR InfiniBand NIC per GPU)")
    s = p.add_argument_group("search")
    s.add_argument("--devices", type=int, help="list the layouts of this many devices that fit --memory-gb")
    s.add_argument("--memory-gb", type=float, help="memory per device, GB (1e9 bytes)")
    s.add_argument("--max-tp", type=int, default=8, help="largest TP size (one node's NVLink domain)")
    s.add_argument("--allow-offload", action="store_true", help="also consider ZeRO CPU offload")
    s.add_argument("--top", type=int, default=10, help="rows to print (0: all)")
    s.add_argument("--best-per-strategy", action="store_true",
                   help="only the best layout of each optimizer-state strategy: megabert's DP, "
                        "--use-distributed-optimizer, DeepSpeed ZeRO-1, 2 and 3")
    return p


def model_from_args(args) -> ModelConfig:
    """The model as pretrain_bert.py builds it: the shape from a preset or the flags, with the
    script's own run-time defaults (the unpadded encoder, logits at the masked tokens), which
    decide what a ModernBERT's local layers keep for backward."""
    shape = {k: getattr(args, k) for k in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                                           "vocab_size", "max_position_embeddings") if getattr(args, k) is not None}
    shape.update({k.split(".", 1)[1]: v for k, v in PRETRAIN_DEFAULTS.items() if k.startswith("model.")})
    if args.preset:
        return PRESETS[args.preset](**shape)
    missing = [f"--{k.replace('_', '-')}" for k in ("num_layers", "hidden_size", "num_attention_heads")
               if k not in shape]
    if missing:
        raise ConfigError(f"give --preset or the model's {', '.join(missing)}")
    return ModelConfig(**shape)


def run_from_args(args, model: ModelConfig) -> Workload:
    precision = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
    mask_prob = args.mask_prob
    if mask_prob is None:
        mask_prob = recipe(model).mask_prob
    return Workload(seq_length=args.seq_length, micro_batch_size=args.micro_batch_size, mask_prob=mask_prob,
                    global_batch_size=args.global_batch_size, precision=precision,
                    recompute=args.recompute_granularity, device=args.device, overhead_gb=args.overhead_gb,
                    overlap_grad_reduce=args.overlap_grad_reduce, overlap_param_gather=args.overlap_param_gather)


def links_from_args(args) -> Links | None:
    if args.tflops is None:
        return None
    return Links(gpus_per_node=args.gpus_per_node, intra_gbit=args.intra_node_gbit, inter_gbit=args.inter_node_gbit)


def layout_from_args(args, model: ModelConfig) -> Layout:
    pp = args.pipeline_model_parallel_size
    v = 1
    if args.num_layers_per_virtual_pipeline_stage:
        per_stage = model.num_layers // max(pp, 1)
        if per_stage % args.num_layers_per_virtual_pipeline_stage:
            raise ConfigError(f"layers per pipeline stage ({per_stage}) is not divisible by "
                              f"--num-layers-per-virtual-pipeline-stage {args.num_layers_per_virtual_pipeline_stage}")
        v = per_stage // args.num_layers_per_virtual_pipeline_stage
    return Layout(tp=args.tensor_model_parallel_size, pp=pp, dp=args.data_parallel_size, virtual_stages=v,
                  sequence_parallel=args.sequence_parallel, zero_stage=args.zero_stage,
                  offload_optimizer=args.zero_offload_optimizer == "cpu",
                  offload_params=args.zero_offload_params == "cpu",
                  distributed_optimizer=args.use_distributed_optimizer,
                  first_stage_layers=args.decoder_first_pipeline_num_layers,
                  last_stage_layers=args.decoder_last_pipeline_num_layers)


def describe(model: ModelConfig, run: Workload) -> str:
    n = total_params(model)
    return (f"model: {model.num_layers} layers, hidden {model.hidden_size}, {model.num_attention_heads} heads, "
            f"ffn {model.ffn_hidden_size}, vocab {model.vocab_size} (padded {model.padded_vocab_size(1)}): "
            f"{n / 1e6:,.1f}M parameters\n"
            f"run: seq {run.seq_length}, micro-batch {run.micro_batch_size}, global batch "
            f"{run.global_batch_size or 'micro x DP'}, {run.precision}, recompute {run.recompute}, AdamW, "
            f"device {run.device}")


def gb(x: float) -> str:
    return f"{x / 1e9:.2f}"


def print_step(step: StepTime, run: Workload, links: Links) -> None:
    samples = run.micro_batch_size * run.microbatches(step.layout.dp) * step.layout.dp
    print(f"predicted step: {step.total_s:.3f} s, {samples / step.total_s:,.0f} samples/s ({links.gpus_per_node} "
          f"per node, {links.intra_gbit:g} / {links.inter_gbit:g} Gbit/s within / between nodes)")
    print(f"  {'compute (bubble incl.)':22} {step.compute_s:8.3f} s")
    for k, v in (("tensor parallel", step.tp_s), ("data parallel", step.dp_s), ("pipeline", step.pp_s),
                 ("tied embeddings", step.embedding_s)):
        print(f"  {k:22} {v:8.3f} s alone")
    print(f"  {'exposed communication':22} {step.exposed_s:8.3f} s ({step.hidden_s:.3f} s hidden by overlap)")


def print_one(model: ModelConfig, run: Workload, layout: Layout, budget: float | None, links: Links | None,
              tflops: float | None) -> None:
    est = estimate(model, run, layout)
    comm = communication(model, run, layout)
    print(describe(model, run))
    print(f"layout: {layout.short()} (world {layout.world_size}): {layout.flags(model)}")
    print(f"predicted peak memory of the fullest rank (pipeline stage {est.stage}): {est.total_gb:.2f} GB")
    for k, v in est.breakdown().items():
        print(f"  {k:18} {v:8.2f} GB")
    for note in est.notes:
        print(f"  note: {note}")
    print(f"predicted communication per step and rank: {gb(comm.total)} GB")
    for k, v in comm.breakdown().items():
        print(f"  {k:22} {gb(v):>8} GB")
    if links is not None:
        print_step(step_time(model, run, layout, links, compute_time(model, run, layout, tflops * 1e12), comm=comm),
                   run, links)
    if budget is not None:
        warning = fit_warning(est, budget)
        print(f"fits {budget:g} GB" if warning is None else f"warning: {warning}")


def strategy(layout: Layout) -> str:
    """How a layout keeps its optimizer states: the rows of --best-per-strategy."""
    if layout.zero_stage:
        return f"ZeRO-{layout.zero_stage}" + (" + offload" if layout.offload_optimizer else "")
    return "distributed optimizer" if layout.distributed_optimizer else "megabert DP"


def print_plan(model: ModelConfig, run: Workload, devices: int, budget: float, max_tp: int, allow_offload: bool,
               top: int, links: Links | None, tflops: float | None, best_per_strategy: bool = False) -> int:
    fits = plan(model, run, devices, budget, max_tp=max_tp, allow_offload=allow_offload, links=links,
                flops_per_s=tflops * 1e12 if tflops else None)
    if best_per_strategy:  # fits is best first: keep each strategy's first
        best: dict = {}
        for c in fits:
            best.setdefault(strategy(c.layout), c)
        fits = list(best.values())
    print(describe(model, run))
    print(f"{devices} devices x {budget:g} GB: {len(fits)} layouts fit (predicted, not measured; memory: the "
          f"fullest rank's peak; communication: GB one rank sends per step, TP / PP / DP+ZeRO)")
    if not fits:
        print("no layout fits: raise --devices, use --recompute-granularity full, --bf16, a smaller "
              "--micro-batch-size, or --allow-offload")
        return 1
    if links is not None:
        print(f"step time: {tflops:g} TFLOP/s per device, {links.gpus_per_node} per node, {links.intra_gbit:g} / "
              f"{links.inter_gbit:g} Gbit/s within / between nodes; shortest first")
    timed = f" {'step s':>7} {'samples/s':>9} {'exposed':>7}" if links is not None else ""
    print(f"{'#':>3} {'layout':22} {'mem GB':>7} {'comm GB':>8} {'TP':>7} {'PP':>7} {'DP/ZeRO':>8}{timed}  flags")
    for i, c in enumerate(fits[: top or None], 1):
        cm = c.comm
        timed = ""
        if c.step is not None:
            samples = run.micro_batch_size * run.microbatches(c.layout.dp) * c.layout.dp
            timed = f" {c.step.total_s:7.3f} {samples / c.step.total_s:9,.0f} {c.step.comm_share:7.0%}"
        print(f"{i:3d} {c.layout.short():22} {c.memory.total_gb:7.2f} {gb(cm.total):>8} {gb(cm.tensor_parallel):>7} "
              f"{gb(cm.pipeline_parallel):>7} {gb(cm.data_parallel + cm.embedding_sync + cm.offload):>8}{timed}  "
              f"{c.layout.flags(model)}")
    if top and len(fits) > top:
        print(f"... {len(fits) - top} more (--top 0 lists all)")
    return 0


@cli_main
def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    model = model_from_args(args)
    run = run_from_args(args, model)
    links = links_from_args(args)
    if args.devices is not None:
        if args.memory_gb is None:
            raise ConfigError("--devices needs --memory-gb (the memory of one device)")
        return print_plan(model, run, args.devices, args.memory_gb, args.max_tp, args.allow_offload, args.top,
                          links, args.tflops, args.best_per_strategy)
    layout = layout_from_args(args, model)
    print_one(model, run, layout, args.memory_gb, links, args.tflops)
    return 0


if __name__ == "__main__":
    sys.exit(main())
