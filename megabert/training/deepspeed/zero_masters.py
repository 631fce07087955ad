"""One copy of the weights under fp32 ZeRO: DeepSpeed's fp32 master partition shares the
storage of the parameter partition it would otherwise clone.

DeepSpeed keeps an fp32 "master" partition for its optimizer and copies it into the
training-precision ("bit16") parameter partition after every step. In an fp32 run both
are fp32 and hold the same values, so the clone is 4 bytes per parameter per DP rank of
pure waste: 20 bytes per parameter over d ranks instead of 16 under ZeRO-3.

ZeRO-3 means to share them: stage3.py's `_create_fp32_partitions` appends the parameter
partition itself when its dtype and device match the master's ("we don't need another
copy"), but compares `tensor.device` (a torch.device) with a device name (a str), which
is never equal, so it clones anyway. ZeRO-1/2 always clone. Sharing is safe in both:
the optimizer updates the master in place, DeepSpeed's copy into the parameter partition
after the step becomes a copy onto itself, and a checkpoint load writes through `.data`
(one write updates both). Offloaded optimizers (the master on the CPU, parameters on the
device) and bf16/fp16 runs keep the separate master: there it is a different tensor.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def _shareable(master: torch.Tensor, partition: torch.Tensor) -> bool:
    return (master.dtype == partition.dtype and master.device == partition.device
            and master.numel() == partition.numel() and master.data_ptr() != partition.data_ptr())


def _share(master: torch.Tensor, partition: torch.Tensor) -> int:
    """Points `master` at `partition`'s storage (same values: the master was cloned from
    it); returns the bytes freed."""
    if not torch.equal(master, partition):
        # A master that already diverged (loaded from elsewhere) must not be dropped.
        return 0
    freed = master.numel() * master.element_size()
    master.data = partition.data
    return freed


def share_fp32_masters(optimizer, zero_stage: int) -> int:
    """Makes DeepSpeed's fp32 master partitions share storage with the parameter
    partitions where both are the same dtype on the same device; returns the bytes
    freed on this rank (0 for bf16/fp16 runs, an offloaded optimizer or stage 0)."""
    freed = 0
    if zero_stage == 3:
        if optimizer.offload_optimizer or optimizer.swap_optimizer:  # set in __init__ (0.19, version.KNOWN)
            return 0
        for partition, master in zip(optimizer.fp16_partitioned_groups_flat, optimizer.fp32_partitioned_groups_flat):
            if partition is not None and _shareable(master, partition):
                freed += _share(master, partition)
    elif zero_stage in (1, 2):
        if optimizer.cpu_offload:
            return 0
        for i, master in enumerate(optimizer.single_partition_of_fp32_groups):
            rank = dist.get_rank(group=optimizer.real_dp_process_group[i])
            partition = optimizer.parallel_partitioned_bit16_groups[i][rank]
            if _shareable(master, partition):
                freed += _share(master, partition)
        if freed:
            # The per-parameter views DeepSpeed made into the old masters (the hp mapping
            # behind safe_get_full_fp32_param and universal checkpoints) would keep the
            # clone alive and go stale: link them to the shared storage again.
            optimizer._link_all_hp_params()
    return freed
