"""Run-time data that any task reads: tokenizers, Megatron's memory-mapped indexed dataset
and the data loader positioned by consumed samples. Task-specific samples live in their
task package (BERT pre-training samples: megabert.tasks.pretraining); offline corpus
tooling in megabert.corpus.

    build_tokenizer(tokenizer_type, vocab_file)
    build_pretraining_data_loader(dataset, consumed_samples, micro_batch_size, dp_rank, dp_size, num_workers)
"""
from megabert.data.indexed_dataset import IndexedDataset, IndexedDatasetWriter
from megabert.data.samplers import PretrainingSampler, build_pretraining_data_loader
from megabert.data.tokenizers import Tokenizer, build_tokenizer

__all__ = ["build_tokenizer", "build_pretraining_data_loader", "Tokenizer", "IndexedDataset", "IndexedDatasetWriter",
           "PretrainingSampler"]
