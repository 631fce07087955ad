"""How much megabert's own data-parallel gradient all-reduce holds at once. The reducers
(megabert.data_parallel), the flag's default (megabert.config) and the layout planner
(megabert.planning) read the same number, so it lives here, below all of them. ZeRO's
buffer sizes: megabert.parallel.zero.
"""
from __future__ import annotations

# --ddp-bucket-size's default: 16 MB of fp32 gradients (PyTorch DDP: 25 MB). Backward
# issues a bucket's all-reduce once all its gradients are in, so smaller buckets start
# sooner and leave less unhidden after backward; below a few MB each message's latency
# starts to show. A 12M-parameter BERT makes 3 buckets, BERT-large 81.
BUCKET_ELEMENTS = 4 * 1024 * 1024
