"""Tensor (intra-layer) model parallelism: Megatron-LM's column/row split of the GEMMs."""
from megabert.tensor_parallel.argmax import vocab_parallel_argmax
from megabert.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megabert.tensor_parallel.layers import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                             shard, unshard)
from megabert.tensor_parallel.mappings import (copy_to_tp, gather_from_sp, gather_from_sp_to_replicated, gather_from_tp, reduce_from_tp,
                                               reduce_scatter_to_sp, scatter_to_sp, scatter_to_tp)
from megabert.tensor_parallel.random import RNGStatesTracker, checkpoint, seed_default_stream

__all__ = [
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "shard", "unshard",
    "vocab_parallel_cross_entropy", "vocab_parallel_argmax", "copy_to_tp", "reduce_from_tp", "scatter_to_tp",
    "gather_from_tp",
    "scatter_to_sp", "gather_from_sp", "gather_from_sp_to_replicated", "reduce_scatter_to_sp", "RNGStatesTracker", "checkpoint",
    "seed_default_stream",
]
