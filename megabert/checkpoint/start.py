"""Where a run starts: one value, decided once from the flags and what is on disk.

`detect_source` is the one place that tells what a checkpoint path holds (its `Format`);
`decide_start` turns the flags into a `RunStart`. `resolve_run` (megabert.training.resolve)
calls it once and logs it once; the model family, the model's weights, the optimizer, the
iteration and the data position all read that value, and nothing detects a format again.

| what the flags say (and the disk holds)                  | weights from          | restores the run's state |
|----------------------------------------------------------|-----------------------|--------------------------|
| nothing                                                  | the seed              | -                        |
| --load X, X a megabert run's checkpoint                  | X                     | yes (iteration, optimizer, loss scale, RNG, data position) |
| --load X, X a Megatron-LM run (`torch`, `torch_dist`)    | X                     | its iteration and samples; its Adam moments when they fit |
| --load X, X converted (`release`), Hugging Face, Google TF | X                   | no: iteration 0, fresh optimizer |
| --load X --finetune                                      | X                     | no                       |
| --save X --load X, X empty (the restart pattern)         | the seed              | - (a re-run resumes X)   |
| --pretrained-checkpoint P (--load/--save L)              | L once it holds one, else P | L: yes; P: no      |
| fine-tuning: --load P --save S                           | P (the pre-trained model) | S once it holds one: yes |

A newest checkpoint whose rank files do not read stops the run naming the file and the newest
intact iteration; under the restart pattern that iteration is resumed after a warning.
"""
from __future__ import annotations

import enum
import os
from dataclasses import dataclass, field
from typing import Optional

from megabert.checkpoint import hf as hf_io
from megabert.checkpoint import megatron
from megabert.checkpoint import tf as tf_io
from megabert.checkpoint.layout import (TRACKER, checkpoint_root, damaged_file, has_checkpoint, newest_intact,
                                        read_tracker, resolve_checkpoint_dir)
from megabert.config import TrainConfig
from megabert.errors import CheckpointError


class Format(enum.Enum):
    """What a checkpoint path holds."""

    MEGABERT = "megabert"
    """A megabert run's checkpoint: rank files of an iteration, with optimizer and RNG state."""
    RELEASE = "megabert release"
    """A converted checkpoint (tracker 'release'): weights only."""
    MEGATRON = "Megatron-LM"
    """A Megatron-LM run's directory (`torch` rank files or `torch_dist`)."""
    HF = "Hugging Face"
    TF = "Google TF"


@dataclass(frozen=True)
class Source:
    """A checkpoint on disk and what it is, detected once (`detect_source`)."""

    path: str
    format: Format
    megatron_args: Optional[dict] = field(default=None, compare=False)
    """A Megatron-LM run's args (its optimizer and schedule flags among them), read with its
    header when it was detected; None for every other format."""
    root: Optional[str] = None
    """A megabert checkpoint's root (the directory with the tracker file, for a path that
    names one of its iteration directories too): where a strategy's own files lie beside it."""

    @property
    def external(self) -> bool:
        """Made by another tool: read into megabert's names on the way in."""
        return self.format in (Format.MEGATRON, Format.HF, Format.TF)

    @property
    def weights_only(self) -> bool:
        """It holds weights and nothing of a run to continue."""
        return self.format in (Format.RELEASE, Format.HF, Format.TF)

    @property
    def directory(self) -> str:
        """The directory of its files (a TF checkpoint may be named by its prefix)."""
        return self.path if os.path.isdir(self.path) else os.path.dirname(self.path)


def detect_source(path: str) -> Optional[Source]:
    """What `path` holds, or None when it holds no checkpoint. Megatron-LM first: its
    directories have the same tracker file as megabert's."""
    if megatron.is_megatron_dir(path):
        return Source(path, Format.MEGATRON, megatron.read_header(path)["args"])
    if hf_io.is_hf_dir(path):
        return Source(path, Format.HF)
    if tf_io.is_tf_dir(path):
        return Source(path, Format.TF)
    if has_checkpoint(path):
        return Source(path, Format.RELEASE if read_tracker(path) == "release" else Format.MEGABERT,
                      root=checkpoint_root(path))
    return None


def require_source(path: str, flag: str = "--load") -> Source:
    """`detect_source`, or a CheckpointError naming `flag` when `path` holds no checkpoint."""
    source = detect_source(path)
    if source is None:
        raise CheckpointError(f"{flag} {path} {_nothing_at(path)}")
    return source


@dataclass(frozen=True)
class RunStart:
    """Where a run starts (see the module docstring's table).

    `source` is what the trainer reads at the start (None: the seed); `weights_only` says it
    gives the weights alone (iteration 0, a fresh optimizer, the data from its start).
    `pretrained` is fine-tuning's pre-trained model (--load), which the task model is built
    from; there `source` is the run's own --save once it holds a checkpoint."""

    source: Optional[Source] = None
    weights_only: bool = False
    flag: str = "--load"
    note: Optional[str] = None
    warn: bool = False
    """The note is a warning (a damaged newest checkpoint passed over)."""
    pretrained: Optional[Source] = None

    @property
    def path(self) -> Optional[str]:
        return self.source.path if self.source is not None else None

    @property
    def architecture(self) -> Optional[Source]:
        """The checkpoint whose config the model takes: fine-tuning's pre-trained model, else
        the start's own checkpoint."""
        return self.pretrained if self.pretrained is not None else self.source

    def describe(self) -> str:
        """The one log line of the decision."""
        parts = []
        if self.pretrained is not None:
            parts.append(f"the model from --load {self.pretrained.path} ({self.pretrained.format.value})")
        if self.source is not None:
            kept = "weights only" if self.weights_only else "resuming its iteration, optimizer and data position"
            parts.append(f"{self.flag} {self.source.path} ({self.source.format.value}; {kept})")
        elif self.pretrained is not None:
            parts.append("a new fine-tuning run (--save holds no checkpoint of it)")
        else:
            parts.append("the seed")
        return "start: " + "; ".join(parts) + (f"; {self.note}" if self.note else "")


def decide_start(train: TrainConfig, *, finetuning: bool = False) -> RunStart:
    """The one decision. Reads the file system only, so every rank decides alike, and a wrong
    path stops the run before its data is built."""
    if finetuning:
        return _finetuning_start(train)
    return _intact(_choose_start(train), train)


def _finetuning_start(train: TrainConfig) -> RunStart:
    """--load is the pre-trained model (already in the task model once built); --save keeps the
    fine-tuned run and, once it holds a checkpoint, the run resumes it with everything
    restored (the restart pattern of pre-training's --save X --load X, whose rules apply)."""
    if not train.load:
        raise CheckpointError("--load is required: a megabert checkpoint or a Hugging Face BERT directory")
    pretrained = require_source(train.load)
    own = detect_source(train.save) if train.save else None
    if own is not None and own.format in (Format.HF, Format.TF):
        own = None  # a Hugging Face / TF export written into --save is not a run to resume
    start = RunStart(own, own is not None and own.weights_only, "--save", pretrained=pretrained)
    if own is None:
        return start
    start = _intact(start, train)
    note = f"--save {train.save} holds this fine-tuning run's checkpoint: resuming it"
    return RunStart(start.source, start.weights_only, "--save", note=start.note or note, warn=start.warn,
                    pretrained=pretrained)


def _nothing_at(path: str) -> str:
    if not os.path.exists(path):
        return "does not exist"
    if os.path.isfile(path):  # model.safetensors or config.json named where their directory belongs
        return f"is a file; it takes a checkpoint's directory (such as {os.path.dirname(os.path.abspath(path))})"
    return f"holds no checkpoint (no {TRACKER}, no mp_rank_* directories, no Hugging Face or TF BERT files)"


def _same_dir(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def _choose_start(train: TrainConfig) -> RunStart:
    """--load (with --finetune: weights only), or Megatron-LM's --pretrained-checkpoint rule:
    the run's own checkpoint (--load, else --save) as soon as it holds one, so the same
    command re-run after an interruption resumes instead of starting over; until then the
    pretrained weights."""
    pretrained = train.pretrained_checkpoint
    if not pretrained:
        if not train.load:
            return RunStart()
        source = detect_source(train.load)
        if source is None:
            if train.save and _same_dir(train.load, train.save) and not train.finetune:
                # Megatron's restart pattern: the same command, re-run by torchrun --max-restarts,
                # another launcher's restart or a requeued SLURM job, resumes once there is something.
                return RunStart(note=f"--load {train.load} holds no checkpoint yet (it is also --save): starting "
                                     f"from the seed; a re-run of this command resumes from it")
            raise CheckpointError(f"--load {train.load} {_nothing_at(train.load)}; point it at a checkpoint, or at "
                                  f"this run's --save directory to start fresh now and resume on a re-run")
        # A Hugging Face / TF directory or a converted ('release') checkpoint has weights only;
        # a Megatron-LM run's directory continues from its iteration, as Megatron's --load.
        flag = "--finetune" if train.finetune else "--load"
        return RunStart(source, train.finetune or source.weights_only, flag)
    own, own_flag = (train.load, "--load") if train.load else (train.save, "--save")
    source = detect_source(own) if own else None
    if source is not None:
        return RunStart(source, False, own_flag, f"{own_flag} {own} holds this run's checkpoint: resuming it; "
                                                 f"--pretrained-checkpoint {pretrained} is not used")
    phase1 = detect_source(pretrained)
    if phase1 is None:
        raise CheckpointError(f"--pretrained-checkpoint {pretrained} {_nothing_at(pretrained)}; point it at the "
                              f"--save directory of the run to start from (phase 1)")
    where = f"{own_flag} {own} holds no checkpoint yet" if own else "no --load or --save to resume from"
    return RunStart(phase1, True, "--pretrained-checkpoint",
                    f"{where}: initialising from --pretrained-checkpoint {pretrained}")


def _intact(start: RunStart, train: TrainConfig) -> RunStart:
    """A truncated or missing rank file in the newest checkpoint (a job killed mid-write on
    a file system without atomic rename, a full disk) stops the run in one line naming the
    file and the newest intact iteration. Under the restart pattern (--save X --load X) the
    run resumes that intact iteration after a warning instead: the same command re-run by
    torchrun or SLURM keeps going. Nothing is deleted either way."""
    source = start.source
    if source is None or source.format is not Format.MEGABERT:
        return start
    try:
        damaged = damaged_file(resolve_checkpoint_dir(source.path))
    except CheckpointError as e:  # the pointer names an iteration directory that is not there
        damaged = str(e)
    if damaged is None:
        return start
    root = checkpoint_root(source.path)
    intact = newest_intact(root) if os.path.isdir(root) else None
    if intact is None:
        raise CheckpointError(f"{start.flag} {source.path}: {damaged}; no intact iteration under {root}: start "
                              f"from the seed with another --save directory")
    ckpt_dir, iteration = intact
    if train.save and _same_dir(root, train.save) and not start.weights_only:
        return RunStart(Source(ckpt_dir, Format.MEGABERT, root=root), False, start.flag, warn=True,
                        note=f"{damaged} cannot be read: resuming the newest intact checkpoint, {ckpt_dir} "
                             f"(iteration {iteration}); the damaged files are left in place",
                        pretrained=start.pretrained)
    raise CheckpointError(f"{damaged} cannot be read; the newest intact checkpoint is {ckpt_dir} (iteration "
                          f"{iteration}): pass {start.flag} {ckpt_dir}, or --save and --load the same directory to "
                          f"resume it on its own")
