"""Per-rank memory of a layout: model states, activations, communication buffers, overhead.

Model states, bytes per parameter element held by a rank (P its parameters, d = dp):
  megabert's trainer (zero_stage 0)  fp32 params 4 P, fp32 grads 4 P, AdamW moments 8 P
      (bf16/fp16 autocast leaves parameters, grads and moments in fp32).
  DeepSpeed ZeRO (p = 2 bytes in bf16/fp16, 4 in fp32), as DeepSpeed's stage_1_and_2.py and
  stage3.py allocate them; the fp32 master copy exists in fp32 runs too (DeepSpeed clones):
      1: params p P, grads p P + the averaged partition p P/d, master + moments 12 P/d
      2: params p P, grads p P/d, 12 P/d
      3: params p P/d (+ tensors under the persistence threshold whole, + the live gathered
         parameters), grads p P/d, 12 P/d
      1, 2: the fp32 gradient partition the step reads, 4 P/d; all: the reduce/all-gather buckets.
      3: the step walks the partition one sub-group (S elements, zero_sizing's sub_group_size)
         at a time: that sub-group's fp32 gradient copy, 4 S (fused AdamW makes no temporaries).
      Offload optimizer: master, moments and an fp32 gradient partition live in host memory
      (DeepSpeedCPUAdam steps in place: no temporaries); offload params: ZeRO-3's parameter
      partition too.
  (DeepSpeed's own estimate_zero3_model_states_mem_needs counts 18 P/d for mixed precision.)

Peak: on a GPU, megabert's trainer frees gradients before each forward
(zero_grad(set_to_none=True)) and the caching allocator reuses activation blocks for them,
so activations (highest after forward) and gradients plus reduction buffers (highest after
backward) do not add up: peak = params + optimizer + max(activations, grads + buffers).
On the CPU, glibc's heap does not hand freed activation pages to the next, differently
sized allocations, so the RSS high-water adds them (measured: the max under-predicted
BERT-base by 0.2 GB). DeepSpeed keeps gradient buffers allocated: everything adds up.
The same heap keeps pages of full-size tensors that DeepSpeed makes and frees once per
step: ZeRO-2's per-parameter gradients before they are copied into the reduce bucket
(p P); under ZeRO-3, one fp32 copy of the model (4 P: the model as megabert builds it
before DeepSpeed partitions it, whose pages gathered parameters and activations reuse
later), and 4 P more with the optimizer offloaded. Both calibrated with bench/memory.py
(fp32, DP=2): BERT-base and BERT-large kept 3.8 and 4.9 bytes per parameter above the
predicted live states under ZeRO-3, and offload another 3.8 and 4.2. Heap, not live
tensors: with glibc told to return every block of 128 KiB or more at once
(MALLOC_MMAP_THRESHOLD_=131072) BERT-large's ZeRO-3 peaked at 4.8 GB instead of 6.8, and
with offload at 5.5 GB instead of 8.2, the 0.7 GB between them the host fp32 gradient
partition. A GPU's caching allocator reuses those blocks instead (bounded by the
live-parameter and bucket sizes), so these terms apply to CPU runs only.

ZeRO bucket and live-parameter sizes come from megabert.training.deepspeed_engine.zero_sizing,
the numbers the DeepSpeed config is built from; this module never restates them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from megabert.config import ModelConfig
from megabert.planning.activations import stage_activation_bytes
from megabert.planning.params import StageParams, stage_params
from megabert.planning.spec import Layout, RunSpec
from megabert.training.deepspeed_engine import zero_sizing
from megabert.training.grads import BUCKET_ELEMENTS

GB = 1e9  # decimal, as peak_memory_gb and nvidia-smi's MB

# Memory a training process holds besides the model's tensors.
# cpu: calibrated with bench/memory.py (peak RSS of pretrain_bert.py, seq 128, micro-batch 2,
#   fp32): what the one-process, TP=2 and PP=2 runs at BERT-base hold beyond the model's
#   tensors (0.76, 0.68, 0.62 GB): the interpreter and torch's libraries (0.3 GB measured
#   alone), gloo, the dataset's pages, allocator slack. BERT-large then checks it (README,
#   "Choosing a layout").
# cuda: an allowance, not measured here: max_memory_allocated excludes the CUDA context
#   (~0.5 GB outside PyTorch's count) but fragmentation, cuBLAS workspaces and NCCL buffers
#   take a few hundred MB inside it.
FRAMEWORK_OVERHEAD_GB = {"cpu": 0.7, "cuda": 1.0}
# DeepSpeed's import and engine on a CPU run: what its ZeRO-1/2/3 runs at BERT-base measured
# beyond the states below (0.11, 0.09, 0.04 GB). On a GPU it lives in host memory.
DEEPSPEED_OVERHEAD_GB = {"cpu": 0.1, "cuda": 0.0}
# glibc's heap high-water under ZeRO-3 on the CPU, bytes per parameter element of the rank's
# model, and what offloading the optimizer adds (calibrated; see the module docstring).
CPU_ZERO3_HEAP_BYTES_PER_PARAM = 4.0
CPU_OFFLOAD_HEAP_BYTES_PER_PARAM = 4.0


@dataclass(frozen=True)
class MemoryEstimate:
    """Predicted peak memory of the fullest rank of a layout, in GB (1e9 bytes), with its parts."""

    model: ModelConfig
    run: RunSpec
    layout: Layout
    stage: int
    """Pipeline stage of the fullest rank (0: embeddings; pp-1: heads and the tied copy)."""
    params_per_rank: int
    """Parameter elements this rank holds before ZeRO partitioning."""
    parameters_gb: float
    gradients_gb: float
    optimizer_gb: float
    activations_gb: float
    buffers_gb: float
    """Communication and step buffers: ZeRO buckets and live parameters, the DP all-reduce bucket."""
    overhead_gb: float
    host_gb: float
    """Offloaded states in host memory (counted in total_gb when the device is the CPU)."""
    total_gb: float
    """The peak the budget must hold."""
    notes: tuple[str, ...] = field(default=())

    def breakdown(self) -> dict[str, float]:
        return {"parameters": self.parameters_gb, "gradients": self.gradients_gb, "optimizer": self.optimizer_gb,
                "activations": self.activations_gb, "buffers": self.buffers_gb, "overhead": self.overhead_gb,
                "host (offloaded)": self.host_gb}


def _model_states(sp: StageParams, model: ModelConfig, run: RunSpec, layout: Layout) -> dict[str, float]:
    """Bytes of parameters, gradients, optimizer states, buffers and host-offloaded states
    of one rank holding `sp` (the rules in the module docstring)."""
    P, d = sp.total, layout.dp
    out = dict(parameters=0.0, gradients=0.0, optimizer=0.0, buffers=0.0, host=0.0)
    if layout.zero_stage == 0:
        out["parameters"] = 4.0 * P
        out["gradients"] = 4.0 * P
        out["optimizer"] = 8.0 * P
        reductions = [0]
        if layout.dp > 1:
            reductions.append(min(BUCKET_ELEMENTS, P))  # one flat fp32 copy per coalesced bucket
        if sp.tied_embedding or (layout.pp > 1 and sp.stage == 0):
            reductions.append(min(BUCKET_ELEMENTS, model.padded_vocab_size(layout.tp) // layout.tp
                                  * model.hidden_size))
        # torch's fused AdamW (build_optimizer's default) steps in place: no temporaries.
        out["buffers"] = 4.0 * max(reductions)
        return out
    sizing = zero_sizing(model.hidden_size)
    p = 2.0 if run.precision in ("bf16", "fp16") else 4.0
    optimizer = 12.0 * P / d  # fp32 master + two AdamW moments, partitioned
    fp32_grad_partition = 4.0 * P / d  # what the optimizer step reads
    if layout.zero_stage == 3:
        persistent = sp.below(sizing["stage3_param_persistence_threshold"])
        partition = p * (P - persistent) / d
        live = min(sizing["stage3_max_live_parameters"] + sizing["stage3_prefetch_bucket_size"], P)
        out["parameters"] = p * persistent + (0.0 if layout.offload_params else partition)
        out["host"] += partition if layout.offload_params else 0.0
        out["buffers"] = p * (live + sizing["reduce_bucket_size"])
        if run.device == "cpu":  # heap high-water, see above
            out["buffers"] += (CPU_ZERO3_HEAP_BYTES_PER_PARAM
                               + (CPU_OFFLOAD_HEAP_BYTES_PER_PARAM if layout.offload_optimizer else 0.0)) * P
        grads = p * P / d
        step_buffers = 4.0 * min(sizing["sub_group_size"], P / d)  # one sub-group's fp32 grads (fused AdamW)
    else:
        out["parameters"] = p * P
        out["buffers"] = p * (sizing["reduce_bucket_size"] + sizing["allgather_bucket_size"])
        grads = p * P + p * P / d if layout.zero_stage == 1 else p * P / d
        if layout.zero_stage == 2 and run.device == "cpu":
            out["buffers"] += p * P  # per-parameter gradients before the bucket copy, heap high-water
        step_buffers = fp32_grad_partition
    out["gradients"] = grads
    if layout.offload_optimizer:
        out["host"] += optimizer + fp32_grad_partition
    else:
        out["optimizer"] = optimizer
        out["buffers"] += step_buffers
    return out


def estimate_stage(model: ModelConfig, run: RunSpec, layout: Layout, stage: int) -> MemoryEstimate:
    """The estimate for one rank of pipeline stage `stage`."""
    layout.check_model(model)
    sp = stage_params(model, layout.tp, layout.pp, stage)
    states = _model_states(sp, model, run, layout)
    activations = stage_activation_bytes(model, run, layout, stage)
    overhead = (run.overhead_gb if run.overhead_gb is not None else FRAMEWORK_OVERHEAD_GB[run.device]
                + (DEEPSPEED_OVERHEAD_GB[run.device] if layout.zero_stage else 0.0))
    resident = states["parameters"] + states["optimizer"]
    if layout.zero_stage == 0 and run.device == "cuda":
        transient = max(activations, states["gradients"] + states["buffers"])
    else:
        transient = activations + states["gradients"] + states["buffers"]
    host = states["host"]
    total = (resident + transient + (host if run.device == "cpu" else 0.0)) / GB + overhead
    notes = []
    if sp.tied_embedding:
        notes.append("last stage holds a copy of the tied word embeddings")
    return MemoryEstimate(model=model, run=run, layout=layout, stage=stage, params_per_rank=sp.total,
                          parameters_gb=states["parameters"] / GB, gradients_gb=states["gradients"] / GB,
                          optimizer_gb=states["optimizer"] / GB, activations_gb=activations / GB,
                          buffers_gb=states["buffers"] / GB, overhead_gb=overhead, host_gb=host / GB,
                          total_gb=total, notes=tuple(notes))


def estimate(model: ModelConfig, run: RunSpec, layout: Layout) -> MemoryEstimate:
    """Predicted peak memory of the fullest rank: the maximum over pipeline stages (the
    first holds the most in-flight activations, the last the heads and the tied copy)."""
    return max((estimate_stage(model, run, layout, k) for k in range(layout.pp)), key=lambda e: e.total_gb)
