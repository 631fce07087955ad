"""What the planner is asked about: the run (batch, precision, recompute) and the layout
(how the ranks split the model and its states). Both are plain typed dataclasses whose
`__post_init__` rejects impossible values with the flag to change, as megabert.config does.

The model itself is megabert.config.ModelConfig, so a preset or the flags of
pretrain_bert.py describe it exactly as training will build it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megabert.config import ModelConfig
from megabert.data_parallel.zero_plan import ZeroPlan
from megabert.errors import ConfigError
from megabert.parallel.layout import StageLayout
from megabert.rules import check_distributed_optimizer, check_model_split, check_sequence_parallel, check_zero

PRECISIONS = ("fp32", "bf16", "fp16")
RECOMPUTE = ("none", "selective", "full")
DEVICES = ("cuda", "cpu")


@dataclass(frozen=True, kw_only=True)
class Workload:
    """The per-step workload and numerics of a training run."""

    seq_length: int = 128
    """Tokens per sample (--seq-length)."""
    micro_batch_size: int = 2
    """Samples per forward pass on one data-parallel rank (--micro-batch-size)."""
    global_batch_size: Optional[int] = None
    """Samples per optimizer step over all ranks (--global-batch-size); None: micro x DP, no accumulation."""
    precision: str = "fp32"
    """fp32, or bf16/fp16 mixed precision. The plain trainer keeps fp32 parameters and
    autocasts; DeepSpeed keeps 16-bit parameters plus an fp32 master copy."""
    recompute: str = "none"
    """Activation recompute (--recompute-granularity): none, selective (attention core) or full (whole layers)."""
    mlm_logits_at_masked_only: bool = True
    """pretrain_bert.py's default fast path: MLM logits only at masked positions."""
    mask_prob: float = 0.15
    """Fraction of tokens predicted by the MLM head (--mask-prob); sizes the logits."""
    device: str = "cuda"
    """cuda: the budget is GPU memory (torch.cuda.max_memory_allocated); cpu: process RSS,
    where offloaded states live in the same memory and count too."""
    overlap_grad_reduce: bool = True
    """DP > 1 without ZeRO (--overlap-grad-reduce): gradients live in one buffer for the
    whole run, reduced in place bucket by bucket (no flat copy); off, they exist from
    backward to the step and each bucket is copied flat to be reduced."""
    overlap_param_gather: bool = True
    """With the distributed optimizer (--overlap-param-gather): each parameter bucket's
    all-gather is waited for by the forward that needs it; off, all after the step."""
    overhead_gb: Optional[float] = None
    """Fixed per-process memory outside the model's tensors; None: the calibrated default
    of `device` (megabert.planning.memory.FRAMEWORK_OVERHEAD_GB)."""

    def __post_init__(self):
        if self.seq_length < 1:
            raise ConfigError(f"--seq-length must be positive, got {self.seq_length}")
        if self.micro_batch_size < 1:
            raise ConfigError(f"--micro-batch-size must be positive, got {self.micro_batch_size}")
        if self.global_batch_size is not None and self.global_batch_size % self.micro_batch_size:
            raise ConfigError(f"--global-batch-size {self.global_batch_size} is not a multiple of "
                              f"--micro-batch-size {self.micro_batch_size}")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"--precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if self.recompute not in RECOMPUTE:
            raise ConfigError(f"--recompute-granularity must be one of {', '.join(RECOMPUTE)}, "
                              f"got {self.recompute!r}")
        if self.device not in DEVICES:
            raise ConfigError(f"--device must be cuda or cpu, got {self.device!r}")
        if not 0.0 < self.mask_prob < 1.0:
            raise ConfigError(f"--mask-prob must be in (0, 1), got {self.mask_prob}")
        if self.overhead_gb is not None and self.overhead_gb < 0:
            raise ConfigError(f"--overhead-gb must be >= 0, got {self.overhead_gb}")

    @property
    def activation_bytes(self) -> int:
        """Bytes per activation element: autocast and DeepSpeed's 16-bit modes compute in 16 bits."""
        return 4 if self.precision == "fp32" else 2

    def microbatches(self, dp: int) -> int:
        """Micro-batches per rank per optimizer step (gradient accumulation x pipeline fill)."""
        if self.global_batch_size is None:
            return 1
        return self.global_batch_size // (self.micro_batch_size * dp)


@dataclass(frozen=True, kw_only=True)
class Layout:
    """How world = tp x pp x dp ranks split one model, and what ZeRO partitions.

    zero_stage 0 is megabert's own trainer (no DeepSpeed); 1-3 are DeepSpeed's ZeRO on the
    data-parallel group (pretrain_bert.py --deepspeed --zero-stage N)."""

    tp: int = 1
    """--tensor-model-parallel-size."""
    pp: int = 1
    """--pipeline-model-parallel-size."""
    dp: int = 1
    """Data-parallel size: world size / (tp x pp)."""
    virtual_stages: int = 1
    """Model chunks per pipeline rank (interleaved 1F1B): layers / (pp x --num-layers-per-virtual-pipeline-stage)."""
    sequence_parallel: bool = False
    """--sequence-parallel: LayerNorm/dropout activations split over TP."""
    zero_stage: int = 0
    """0: megabert's trainer; 1, 2, 3: DeepSpeed ZeRO (--deepspeed --zero-stage)."""
    offload_optimizer: bool = False
    """--zero-offload-optimizer cpu: fp32 master, moments (and ZeRO-2/3 gradient partitions) in host memory."""
    offload_params: bool = False
    """--zero-offload-params cpu: ZeRO-3 parameter partitions in host memory."""
    distributed_optimizer: bool = False
    """--use-distributed-optimizer (zero_stage 0 only): megabert's own trainer with the
    AdamW/LAMB moments sharded over DP, gradients reduce-scattered, parameters all-gathered."""
    first_stage_layers: Optional[int] = None
    """--decoder-first-pipeline-num-layers (uneven stages; the others share the rest)."""
    last_stage_layers: Optional[int] = None
    """--decoder-last-pipeline-num-layers."""

    def __post_init__(self):
        for name, flag in (("tp", "--tensor-model-parallel-size"), ("pp", "--pipeline-model-parallel-size"),
                           ("dp", "data-parallel size"), ("virtual_stages", "virtual pipeline stages")):
            if getattr(self, name) < 1:
                raise ConfigError(f"{flag} must be >= 1, got {getattr(self, name)}")
        if self.virtual_stages > 1 and self.pp == 1:
            raise ConfigError("--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1")
        check_zero(ZeroPlan(stage=self.zero_stage, offload_optimizer=self.offload_optimizer,
                            offload_params=self.offload_params), pp=self.pp, deepspeed=self.zero_stage > 0)
        if self.sequence_parallel and self.tp == 1:
            raise ConfigError("--sequence-parallel needs --tensor-model-parallel-size > 1")
        check_sequence_parallel(self.sequence_parallel, deepspeed=self.zero_stage > 0)
        check_distributed_optimizer(self.distributed_optimizer, deepspeed=self.zero_stage > 0,
                                    overlap_grad_reduce=True)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def model_parallel_size(self) -> int:
        return self.tp * self.pp

    def check_model(self, model: ModelConfig) -> None:
        """The divisibility rules of megabert.rules, for a layout with no world yet."""
        per_chunk = model.num_layers // (self.pp * self.virtual_stages) if self.virtual_stages > 1 else None
        if per_chunk is not None and model.num_layers % (self.pp * self.virtual_stages):
            raise ConfigError(f"--num-layers {model.num_layers} is not divisible by --pipeline-model-parallel-size "
                              f"{self.pp} x {self.virtual_stages} virtual stages")
        check_model_split(model, self.tp, self.pp, per_chunk, self.first_stage_layers, self.last_stage_layers)

    def stage(self, model: ModelConfig, stage: int) -> StageLayout:
        """Pipeline stage `stage`'s layers, as megabert.parallel.layout splits them for a run."""
        per_chunk = model.num_layers // (self.pp * self.virtual_stages) if self.virtual_stages > 1 else None
        return StageLayout(model.num_layers, self.pp, stage, per_chunk, self.first_stage_layers,
                           self.last_stage_layers)

    def flags(self, model: Optional[ModelConfig] = None) -> str:
        """The pretrain_bert.py flags of this layout (launch world_size processes)."""
        parts = [f"--tensor-model-parallel-size {self.tp}", f"--pipeline-model-parallel-size {self.pp}"]
        if self.virtual_stages > 1 and model is not None:
            per_chunk = model.num_layers // (self.pp * self.virtual_stages)
            parts.append(f"--num-layers-per-virtual-pipeline-stage {per_chunk}")
        if self.first_stage_layers is not None:
            parts.append(f"--decoder-first-pipeline-num-layers {self.first_stage_layers}")
        if self.last_stage_layers is not None:
            parts.append(f"--decoder-last-pipeline-num-layers {self.last_stage_layers}")
        if self.sequence_parallel:
            parts.append("--sequence-parallel")
        if self.zero_stage:
            parts.append(f"--deepspeed --zero-stage {self.zero_stage}")
        if self.distributed_optimizer:
            parts.append("--use-distributed-optimizer")
        if self.offload_optimizer:
            parts.append("--zero-offload-optimizer cpu")
        if self.offload_params:
            parts.append("--zero-offload-params cpu")
        return " ".join(parts)

    def short(self) -> str:
        """A compact name for tables: tp2.pp4(v2).dp8.z1+sp."""
        name = f"tp{self.tp}.pp{self.pp}" + (f"(v{self.virtual_stages})" if self.virtual_stages > 1 else "")
        split = [f"{end} {n}" for end, n in (("first", self.first_stage_layers), ("last", self.last_stage_layers))
                 if n is not None]
        if split:
            name += f"({', '.join(split)})"
        name += f".dp{self.dp}.z{self.zero_stage}"
        if self.sequence_parallel:
            name += "+sp"
        if self.distributed_optimizer:
            name += "+do"
        if self.offload_optimizer:
            name += "+oo"
        if self.offload_params:
            name += "+op"
        return name
