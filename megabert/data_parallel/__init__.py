"""megabert's own data parallelism (the engine's ZeRO enters through megabert.training's one
door): gradients averaged over the data-parallel group, and the distributed optimizer that
shards the optimizer states over it. One concern per module:

    grad_buckets.py           the gradient buffer and its buckets, reduced in order while
                              backward runs: the component both reducers below are built on
    overlap.py                plain DP: each bucket all-reduced (--overlap-grad-reduce)
    sharded_buffers.py        the distributed optimizer's buffers: buckets reduce-scattered,
                              parameters all-gathered bucket by bucket
    bucket_layout.py          the arithmetic: buckets cut from the parameters, padded and
                              split into one shard per rank, each rank's pieces of parameters
    ring.py                   reduce-scatter and all-gather as rings of send/recv (gloo)
    averaging.py              the average after backward (--no-overlap-grad-reduce, DP = 1)
    distributed_optimizer.py  the optimizer over this rank's pieces, its states by name
    sharded_lamb.py           LAMB whose trust ratios sum the pieces' norms over the group
    zero_plan.py              ZeRO as the run plans it (stage, offload, the engine's buffer sizes)

Layering: below megabert.training (which runs these inside a step), above megabert.parallel
(groups, the communication door, ParamSpec), megabert.optim and megabert.config. The rules
and the layout planner read the ZeRO plan from here (nothing here reads them); the bucket
size default is the config's (megabert.config.BUCKET_ELEMENTS), which this package reads.
"""
