"""Data: tokenizers, Megatron's indexed dataset, BERT samples and the pre-training data loader."""
from megabert.data.indexed_dataset import IndexedDataset, IndexedDatasetWriter
from megabert.data.tokenizers import build_tokenizer

__all__ = ["build_tokenizer", "IndexedDataset", "IndexedDatasetWriter"]
