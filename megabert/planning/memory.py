"""Per-rank memory of a layout: model states, activations, communication buffers, overhead.

Model states, bytes per parameter element held by a rank (P its parameters, d = dp):
  megabert's trainer (zero_stage 0)  fp32 params 4 P, fp32 grads 4 P, AdamW moments 8 P
      (bf16/fp16 autocast leaves parameters, grads and moments in fp32); with the
      distributed optimizer (--use-distributed-optimizer) the moments are 8 P/d.
  DeepSpeed ZeRO (p = 2 bytes in bf16/fp16, 4 in fp32), as DeepSpeed's stage_1_and_2.py and
  stage3.py allocate them; AdamW's moments 8 P/d, and an fp32 master 4 P/d except in fp32
  runs, where it shares the parameter partition (megabert.training.deepspeed.zero_masters):
      1: params p P, grads p P, then the reduced partition p P/d and the flat fp32 copy of it
         the step reads, 4 P/d
      2: params p P, a contiguous gradient partition p P/d (+ its flat fp32 copy, 4 P/d)
      3: params p P/d (+ tensors under the persistence threshold whole, + the live gathered
         parameters), grads p P/d; the step walks the partition one sub-group (S elements,
         ZeroBuckets.sub_group_size) at a time: that sub-group's fp32 gradients, 4 S.
      Offload optimizer: master, moments and an fp32 gradient partition live in host memory
      (the fused AdamW steps them in place: no temporaries); offload params: ZeRO-3's parameter
      partition too.
  (DeepSpeed's own estimate_zero3_model_states_mem_needs counts 18 P/d for mixed precision.)

Peak: parameters and optimizer states stay; on top of them a step has two phases, and the
peak is the larger: backward (activations, the gradients it has made, the buffers that
reduce them while it runs: the DP all-reduce bucket, ZeRO's reduce bucket and ZeRO-3's
gathered parameters) and the step after it (the gradients, the flat copies the reduction
and the optimizer read, the tied embeddings' all-reduce).
On a GPU, megabert's trainer frees gradients before each forward
(zero_grad(set_to_none=True)) and the caching allocator reuses activation blocks for them:
peak = params + optimizer + max(activations, grads + buffers).
On the CPU, glibc's heap does not hand activation pages freed during backward to the
gradients made meanwhile, so backward adds them; and it keeps pages of tensors DeepSpeed
makes and frees every step: ZeRO-2's per-parameter gradients before their bucket copy
(and autograd's, added into megabert's gradient buffer: 2 bytes per parameter each),
ZeRO-3's gathered parameters (its peak is 6 bytes per parameter above the live states,
8 with the optimizer offloaded). Calibrated with bench/memory.py (fp32, DP=2, BERT-base
and BERT-large; docs/layouts-and-planner.md). With glibc told to return every block of 128
KiB or more at once (MALLOC_MMAP_THRESHOLD_=131072) BERT-base's ZeRO-3 peaked at 1.83 GB
instead of 2.48, at 37% more time per step, so the planner predicts the default
allocator. A GPU's caching allocator reuses those blocks instead (bounded by the
live-parameter and bucket sizes), so the heap terms apply to CPU runs only.

ZeRO bucket and live-parameter sizes come from megabert.data_parallel.zero_plan.ZeroBuckets,
the numbers the DeepSpeed config is built from; this module never restates them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from megabert.config import ModelConfig
from megabert.config import BUCKET_ELEMENTS
from megabert.data_parallel.zero_plan import ZeroBuckets
from megabert.planning.activations import stage_activation_bytes
from megabert.planning.params import StageParams, stage_params
from megabert.planning.spec import Layout, Workload

GB = 1e9  # decimal, as peak_memory_gb and nvidia-smi's MB

# Memory a training process holds besides the model's tensors.
# cpu: calibrated with bench/memory.py (peak RSS of pretrain_bert.py, seq 128, micro-batch 2,
#   fp32): what the one-process, TP=2 and DP=2 runs of BERT-base and BERT-large hold beyond
#   the model's states and activations (0.50 to 0.65 GB): the interpreter and torch's
#   libraries (0.3 GB measured alone), gloo, the dataset's pages, allocator slack.
# cuda: an allowance, not measured here: max_memory_allocated excludes the CUDA context
#   (~0.5 GB outside PyTorch's count) but fragmentation, cuBLAS workspaces and NCCL buffers
#   take a few hundred MB inside it.
FRAMEWORK_OVERHEAD_GB = {"cpu": 0.55, "cuda": 1.0}
# DeepSpeed's import and its wrapper's state on a CPU run. On a GPU it lives in host memory.
DEEPSPEED_OVERHEAD_GB = {"cpu": 0.1, "cuda": 0.0}
# glibc's heap high-water on the CPU, bytes per parameter element of the rank's model
# (calibrated; see the module docstring): ZeRO-2's per-parameter gradients waiting for
# their bucket, ZeRO-3's gathered parameters, and what offloading ZeRO-3's optimizer adds.
CPU_ZERO2_HEAP_BYTES_PER_PARAM = 2.0
CPU_ZERO3_HEAP_BYTES_PER_PARAM = 6.0
CPU_OFFLOAD_HEAP_BYTES_PER_PARAM = 2.0
# megabert's trainer with a gradient buffer on the CPU (DP > 1 with the overlapped
# reduction, or the distributed optimizer): `.grad` is a view of the buffer, so autograd
# makes each parameter's gradient in a fresh tensor and adds it in, and glibc keeps those
# pages as it keeps ZeRO-2's per-parameter gradients (above). A single process has no
# buffer (autograd's tensors become the `.grad`s) and measures at its prediction.
# Calibrated with bench/memory.py (fp32, seq 128, micro-batch 2, GB over the prediction
# without this term): BERT-large 2.0 bytes per parameter at DP=2 (plain and distributed
# optimizer alike) and 2.2 at DP=4 (distributed optimizer), BERT-base 0.8 to 1.8.
# (Before issue 32's fix the distributed optimizer also paid gloo's staging copies, 5
# bytes per parameter more: its reduce-scatters and all-gathers now work in place.)
CPU_GRAD_BUFFER_HEAP_BYTES_PER_PARAM = 2.0


@dataclass(frozen=True)
class MemoryEstimate:
    """Predicted peak memory of the fullest rank of a layout, in GB (1e9 bytes), with its parts."""

    model: ModelConfig
    run: Workload
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


@dataclass(frozen=True)
class _States:
    """Bytes one rank holds for the model (see the module docstring)."""

    parameters: float
    optimizer: float
    gradients: float
    """After backward: what the step reads."""
    backward: float
    """Besides activations, during backward: the gradients made so far and the buffers
    that reduce them meanwhile."""
    step: float
    """After backward: the gradients and the flat copies the reduction and the step make."""
    heap: float = 0.0
    """CPU only: glibc's heap high-water beyond the live tensors."""
    forward: float = 0.0
    """Besides activations, during forward: a gradient buffer that lives across steps."""
    host: float = 0.0
    """Offloaded states (host memory)."""


def _model_states(sp: StageParams, model: ModelConfig, run: Workload, layout: Layout) -> _States:
    """Bytes of parameters, gradients, optimizer states and buffers of one rank holding `sp`."""
    P, d = sp.total, layout.dp
    cpu = run.device == "cpu"
    if layout.zero_stage == 0:
        grads = 4.0 * P
        overlapped = layout.dp > 1 and run.overlap_grad_reduce
        # Overlapped: the gradient buffer is reduced in place and stays for the whole run
        # (forward included); else one flat copy per bucket, gradients freed each step.
        dp_bucket = 4.0 * min(BUCKET_ELEMENTS, P) if layout.dp > 1 and not overlapped else 0.0
        tied = 0.0
        if sp.tied_embedding or (layout.pp > 1 and sp.stage == 0):
            tied = 4.0 * min(BUCKET_ELEMENTS, model.padded_vocab_size(layout.tp) // layout.tp * model.hidden_size)
        # torch's fused AdamW (build_optimizer's default) steps in place: no temporaries.
        # The distributed optimizer keeps the moments of its 1/DP shard only; its parameter
        # and gradient buffers are the trainer's (padding: < 128 elements per bucket), the
        # reduce-scatter and all-gather run in place.
        optimizer = 8.0 * P / d if layout.distributed_optimizer else 8.0 * P
        buffered = overlapped or layout.distributed_optimizer
        heap = CPU_GRAD_BUFFER_HEAP_BYTES_PER_PARAM * P if cpu and buffered else 0.0
        return _States(parameters=4.0 * P, optimizer=optimizer, gradients=grads, backward=grads + dp_bucket,
                       step=grads + tied, forward=grads if overlapped else 0.0, heap=heap)
    sizing = ZeroBuckets.for_hidden_size(model.hidden_size)
    p = 2.0 if run.precision in ("bf16", "fp16") else 4.0
    # AdamW's two moments and the fp32 master, partitioned; in fp32 the master shares the
    # parameter partition (training.deepspeed.zero_masters) unless the optimizer is offloaded.
    master = 0.0 if p == 4.0 and not layout.offload_optimizer else 4.0
    optimizer = (8.0 + master) * P / d
    fp32_grad_partition = 4.0 * P / d  # the flat copy the optimizer step reads
    reduce_bucket = p * sizing.reduce_bucket
    host = 0.0
    heap = 0.0
    if layout.zero_stage == 3:
        persistent = sp.below(sizing.param_persistence_threshold)
        partition = p * (P - persistent) / d
        live = p * min(sizing.max_live_parameters + sizing.prefetch_bucket, P)
        parameters = p * persistent + (0.0 if layout.offload_params else partition)
        host += partition if layout.offload_params else 0.0
        grads = p * P / d
        backward = grads + live + reduce_bucket
        # One sub-group's fp32 gradients (fused AdamW); offloaded, the step reads the host copy.
        step = grads + (0.0 if layout.offload_optimizer else 4.0 * min(sizing.sub_group_size, P / d))
        if cpu:
            heap = (CPU_ZERO3_HEAP_BYTES_PER_PARAM
                    + (CPU_OFFLOAD_HEAP_BYTES_PER_PARAM if layout.offload_optimizer else 0.0)) * P
    else:
        parameters = p * P
        if layout.zero_stage == 1:  # reduced after backward (no overlap_comm)
            grads = p * P + p * P / d
            backward = p * P
        else:
            grads = p * P / d
            backward = grads + reduce_bucket + p * sizing.allgather_bucket
            if cpu:
                heap = CPU_ZERO2_HEAP_BYTES_PER_PARAM * P
        step = grads + (0.0 if layout.offload_optimizer else fp32_grad_partition)
    if layout.offload_optimizer:
        host += optimizer + fp32_grad_partition
        optimizer = 0.0
    return _States(parameters=parameters, optimizer=optimizer, gradients=grads, backward=backward, step=step,
                   heap=heap, host=host)


def estimate_stage(model: ModelConfig, run: Workload, layout: Layout, stage: int) -> MemoryEstimate:
    """The estimate for one rank of pipeline stage `stage`."""
    layout.check_model(model)
    sp = stage_params(model, layout.tp, layout.pp, stage, len(layout.stage(model, stage).layer_ids))
    states = _model_states(sp, model, run, layout)
    activations = stage_activation_bytes(model, run, layout, stage)
    overhead = (run.overhead_gb if run.overhead_gb is not None else FRAMEWORK_OVERHEAD_GB[run.device]
                + (DEEPSPEED_OVERHEAD_GB[run.device] if layout.zero_stage else 0.0))
    resident = states.parameters + states.optimizer
    if layout.zero_stage == 0 and run.device == "cuda":
        transient = max(activations + states.forward, states.step)
    else:
        transient = max(activations + states.backward, states.step)
    # What the peak phase holds besides activations and gradients.
    buffers = transient - states.gradients - (activations if transient > states.step else 0.0)
    buffers = max(buffers, 0.0) + states.heap
    total = (resident + transient + states.heap + (states.host if run.device == "cpu" else 0.0)) / GB + overhead
    notes = []
    if sp.tied_embedding:
        notes.append("last stage holds a copy of the tied word embeddings")
    return MemoryEstimate(model=model, run=run, layout=layout, stage=stage, params_per_rank=sp.total,
                          parameters_gb=states.parameters / GB, gradients_gb=states.gradients / GB,
                          optimizer_gb=states.optimizer / GB, activations_gb=activations / GB,
                          buffers_gb=buffers / GB, overhead_gb=overhead, host_gb=states.host / GB,
                          total_gb=total, notes=tuple(notes))


def estimate(model: ModelConfig, run: Workload, layout: Layout) -> MemoryEstimate:
    """Predicted peak memory of the fullest rank: the maximum over pipeline stages (the
    first holds the most in-flight activations, the last the heads and the tied copy)."""
    return max((estimate_stage(model, run, layout, k) for k in range(layout.pp)), key=lambda e: e.total_gb)
