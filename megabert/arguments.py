"""The CLI, generated from the config dataclasses (one flag per field, Megatron names).

`parse_args()` returns a `Configs` bundle of typed configs; nothing in the library reads
an args namespace. `--preset` fills the model's defaults; explicit flags win over it.
"""
from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Optional, Sequence

from megabert.config import Configs, DataConfig, FinetuneConfigs, ModelConfig, OptimConfig, ParallelConfig, TrainConfig
from megabert.presets import PRESETS
from megabert.errors import ConfigError
from megabert.families import FAMILIES, scratch_config
from megabert.families.run_family import resolve_model_family
from megabert.rules import check_flags


SECTIONS = {"model": ModelConfig, "parallel": ParallelConfig, "data": DataConfig,
            "optim": OptimConfig, "train": TrainConfig}
PRETRAIN_SECTIONS = ("model", "parallel", "data", "optim", "train")
FINETUNE_SECTIONS = ("parallel", "optim", "train", "finetune")
# The "finetune" section is the task's own config dataclass, handed to parse_finetune_args.
# Flags of the shared sections that mean nothing for fine-tuning (no validation
# split, steps from --epochs, --load is the pre-trained model): left out of its CLI.
# --memory-budget-gb too: the planner's preflight needs the model's shape before the model
# is built, which fine-tuning only learns by loading --load, and it models pre-training's
# heads and activations (MLM logits), not a task head at --max-seq-length.
FINETUNE_EXCLUDED = {"train.train_iters", "train.eval_interval", "train.eval_iters", "train.finetune",
                     "train.exit_interval", "train.pretrained_checkpoint", "train.memory_budget_gb"}
# BERT's fine-tuning recipe (Devlin et al. 2019; Google's run_squad.py and run_classifier.py):
# AdamW at 3e-5 with 10% linear warmup, then linear decay to 0, weight decay 0.01. A task may
# hand its own (parse_finetune_args' `defaults`).
# pretrain_bert.py's defaults where they differ from the library's: the trainer always has
# labels, so the [tokens, vocab] MLM GEMM runs only at the ~15% masked positions (the loss
# is the same; the Python API keeps transformers' full logits unless asked).
# Likewise padding costs no GEMM FLOPs (the unpadded encoder), except with sequence
# parallelism, which splits the padded sequence: there it stays off unless typed (an error).
PRETRAIN_DEFAULTS = {"model.mlm_logits_at_masked_only": True, "model.unpad_input": True}
FINETUNE_DEFAULTS = {"optim.lr": 3e-5, "optim.lr_warmup_fraction": 0.1, "optim.lr_decay_style": "linear",
                     "optim.weight_decay": 0.01}


def _flags(f: dataclasses.Field) -> list[str]:
    """The field's flag, plus the other spelling when its name has both (Megatron writes
    --deepspeed_config, most other flags with dashes; users type either), and its aliases."""
    flag = f.metadata.get("flag") or "--" + f.name.replace("_", "-")
    other = "--" + flag[2:].replace("_", "-") if "_" in flag else None
    return ([flag, other] if other else [flag]) + list(f.metadata.get("aliases", ()))


class ArgumentParser(argparse.ArgumentParser):
    """argparse with one-line errors: a wrong flag is one line on stderr and exit code 2,
    not an 80-line usage block that buries the message (`--help` still shows it all)."""

    def error(self, message: str):
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


# Flags whose choices only the registry knows (megabert.config sits below megabert.families,
# which builds on its ModelConfig).
REGISTRY_CHOICES = {"model.model_family": tuple(FAMILIES)}


class _DefaultsHelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the scripts' docstrings as written and shows each flag's default."""


def _help_with_default(help_: str, default) -> str:
    if isinstance(default, bool) or default is None:
        shown = {True: "on", False: "off", None: "none"}[default]
    elif isinstance(default, (list, tuple)):
        shown = " ".join(map(str, default)) or "none"
    else:
        shown = default
    return f"{help_} (default: {shown})"


def _base_type(tp) -> type:
    """Optional[int] -> int; list -> str (items), bool stays bool."""
    if isinstance(tp, str):
        tp = eval(tp, vars(typing), {})  # annotations are strings under `from __future__ import annotations`
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0] if args else tp


def add_config_arguments(parser: argparse.ArgumentParser, sections: Sequence[str] = PRETRAIN_SECTIONS,
                         exclude: frozenset | set = frozenset(), defaults: Optional[dict] = None,
                         classes: Optional[dict] = None) -> None:
    """One flag per field of each section (`exclude`: "section.field" names to leave out;
    `defaults`: the script's own defaults where they differ from the dataclasses', shown
    in --help; `classes`: sections beyond SECTIONS, e.g. {"finetune": a task's config}).
    Flags default to SUPPRESS so the namespace holds only what was typed."""
    defaults = defaults or {}
    classes = {**SECTIONS, **(classes or {})}
    for section in sections:
        cls = classes[section]
        group = parser.add_argument_group(section, (cls.__doc__ or "").strip().splitlines()[0])
        for f in dataclasses.fields(cls):
            if not f.metadata.get("cli", True) or f"{section}.{f.name}" in exclude:
                continue
            kind = _base_type(f.type)
            dest = f"{section}.{f.name}"
            default = defaults.get(dest, f.default_factory() if f.default is dataclasses.MISSING else f.default)
            help_ = _help_with_default(f.metadata.get("help", ""), default)
            metavar = f.name.upper()
            if kind is bool:
                # BooleanOptionalAction gives --x and --no-x; the default comes from the dataclass.
                group.add_argument(*_flags(f), dest=dest, action=argparse.BooleanOptionalAction,
                                   default=argparse.SUPPRESS, help=help_)
            elif kind is list:
                group.add_argument(*_flags(f), dest=dest, nargs="+", default=argparse.SUPPRESS, help=help_,
                                   metavar=metavar)
            else:
                choices = f.metadata.get("choices") or REGISTRY_CHOICES.get(dest)
                if choices is not None:
                    choices = [c for c in choices if c is not None]
                group.add_argument(*_flags(f), dest=dest, type=kind, choices=choices,
                                   default=argparse.SUPPRESS, help=help_, metavar=None if choices else metavar)
    if "model" in sections:
        parser.add_argument("--preset", choices=sorted(PRESETS), default=None,
                            help="Model size preset; explicit model flags override it (default: the ModelConfig "
                                 "defaults above, a bert-tiny).")
        parser.add_argument("--bert-no-binary-head", dest="model.bert_binary_head", action="store_false",
                            default=argparse.SUPPRESS, help="Train masked LM only, without the SOP/NSP head (default: "
                                                                "the head is trained).")


def configs_from_namespace(ns: argparse.Namespace, sections: Sequence[str] = PRETRAIN_SECTIONS,
                           classes: Optional[dict] = None) -> dict:
    """Builds each section's dataclass from the parsed flags (raises ConfigError)."""
    classes = {**SECTIONS, **(classes or {})}
    values: dict[str, dict] = {s: {} for s in sections}
    for key, value in vars(ns).items():
        if "." in key:
            section, name = key.split(".", 1)
            if section in values:
                values[section][name] = value
    out = {}
    for section in sections:
        if section == "model" and ns.preset:  # the model section comes with --preset (default None)
            out[section] = PRESETS[ns.preset](**values[section])
        elif section == "model":  # --model-family NAME: its defaults (MLP width) where a flag is left out
            out[section] = scratch_config(**values[section])
        else:
            out[section] = classes[section](**values[section])
    return out


def explicit_flags(ns: argparse.Namespace) -> frozenset:
    """The "section.field" names given on the command line (defaults are SUPPRESSed, so
    only flags the user typed reach the namespace)."""
    return frozenset(k for k in vars(ns) if "." in k)


def parse_args(argv: Optional[Sequence[str]] = None, description: str = "") -> Configs:
    parser = ArgumentParser(description=description, formatter_class=_DefaultsHelpFormatter)
    add_config_arguments(parser, defaults=PRETRAIN_DEFAULTS)
    # The deepspeed launcher appends --local_rank=N; the local rank is read from the
    # environment (LOCAL_RANK), so the flag is accepted and ignored.
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    known = parser.parse_known_args(argv)[0]
    typed = explicit_flags(known)  # before pretrain_bert.py's defaults fill in
    defaults = dict(PRETRAIN_DEFAULTS)
    if getattr(known, "model.sequence_parallel", False):  # SUPPRESS'd: absent unless given
        defaults["model.unpad_input"] = False
    parser.set_defaults(**defaults)
    ns = parser.parse_args(argv)
    # A broken rule raises ConfigError: the entry script's cli_main prints its one line.
    cfg = Configs(**configs_from_namespace(ns), explicit=typed)
    cfg = resolve_model_family(cfg)  # ModernBERT: its defaults, or a loaded checkpoint's architecture
    check_flags(cfg)  # the rules between flags, before any process starts (megabert.rules)
    return cfg


@dataclasses.dataclass(frozen=True)
class Cli:
    """An entry script's command line, as its task declares it (megabert.training.driver.Task.cli):
    pre-training's flags, or the fine-tuning flags plus a task's own section."""

    task_config: Optional[type] = None
    """The fine-tuning task's config dataclass (the "finetune" section); None: pre-training."""
    defaults: Optional[dict] = None
    """A fine-tuning task's recipe where it differs from the dataclasses' (FINETUNE_DEFAULTS when None)."""


def parse_cli(argv: Optional[Sequence[str]], description: str, cli: Cli) -> Configs | FinetuneConfigs:
    """`argv` read as `cli` says: parse_args for pre-training, else parse_finetune_args."""
    if cli.task_config is None:
        return parse_args(argv, description)
    return parse_finetune_args(argv, description, task_config=cli.task_config, defaults=cli.defaults)


def parse_finetune_args(argv: Optional[Sequence[str]] = None, description: str = "", *, task_config: type,
                        defaults: Optional[dict] = None) -> FinetuneConfigs:
    """A fine-tuning entry script's CLI: the parallel, optimizer and training flags shared
    with pre-training plus the task's own (`task_config`: its config dataclass, the
    "finetune" section). `defaults`: the task's recipe where it differs from the
    dataclasses' (default FINETUNE_DEFAULTS, BERT's fine-tuning recipe)."""
    defaults = FINETUNE_DEFAULTS if defaults is None else defaults
    classes = {"finetune": task_config}
    parser = ArgumentParser(description=description, formatter_class=_DefaultsHelpFormatter)
    add_config_arguments(parser, FINETUNE_SECTIONS, exclude=FINETUNE_EXCLUDED, defaults=defaults, classes=classes)
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    typed = explicit_flags(parser.parse_known_args(argv)[0])  # before the fine-tuning defaults fill in
    parser.set_defaults(**defaults)
    ns = parser.parse_args(argv)
    cfg = FinetuneConfigs(**configs_from_namespace(ns, FINETUNE_SECTIONS, classes), explicit=typed)
    if not cfg.train.load:
        raise ConfigError("--load is required: a megabert checkpoint or a Hugging Face BERT directory")
    check_flags(cfg)  # the rules between flags, before any process starts (megabert.rules)
    return cfg
