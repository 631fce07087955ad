"""How much the data-parallel reductions hold at once: the bucket of megabert's own
gradient all-reduce and DeepSpeed ZeRO's buffer sizes scaled to the model. Training uses
them and the layout planner (megabert.planning) predicts with the same numbers, so both
read them from here, below either.
"""
from __future__ import annotations

# --ddp-bucket-size's default: 16 MB of fp32 gradients (PyTorch DDP: 25 MB). Backward
# issues a bucket's all-reduce once all its gradients are in, so smaller buckets start
# sooner and leave less unhidden after backward; below a few MB each message's latency
# starts to show. A 12M-parameter BERT makes 3 buckets, BERT-large 81.
BUCKET_ELEMENTS = 4 * 1024 * 1024


def zero_sizing(hidden_size: int) -> dict:
    """ZeRO buffer sizes scaled to the model, as transformers' DeepSpeed integration fills
    its "auto" values; DeepSpeed's own defaults (5e8-element buckets, 1e9 live
    parameters) would let ZeRO-3 gather all of BERT-large at once and save nothing.

    One transformer layer holds 12 h^2 weights (QKV 3h^2, output h^2, MLP 8h^2); ZeRO-3
    keeps at most two layers' worth gathered, parameters smaller than 10 h stay
    unpartitioned (LayerNorms, biases: gathering them costs more than it saves), and its
    optimizer step walks the partition two layers' worth at a time (sub_group_size):
    DeepSpeed's default of 1e9 elements steps a BERT-large partition in one piece, and the
    fp32 gradient copy it makes plus AdamW's temporaries (sqrt, then the denominator) were
    three partition-sized tensors at once (bench/memory.py: BERT-large ZeRO-3 DP=2 peaked
    at 8.2 GB per rank, above one process's 7.0; 6.8 GB with sub-groups, same losses).
    The layout planner (megabert.planning) reads these same numbers."""
    h2 = hidden_size * hidden_size
    return {
        "reduce_bucket_size": h2,
        "allgather_bucket_size": h2,
        "stage3_prefetch_bucket_size": int(0.9 * h2),
        "stage3_param_persistence_threshold": 10 * hidden_size,
        "stage3_max_live_parameters": 2 * 12 * h2,
        "stage3_max_reuse_distance": 2 * 12 * h2,
        "sub_group_size": 2 * 12 * h2,
        "overlap_comm": True,
        "contiguous_gradients": True,
    }
