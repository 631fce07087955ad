"""Data: tokenizers, Megatron's indexed dataset, BERT samples and the pre-training data loader.

The trainer's entry points:
    build_tokenizer(tokenizer_type, vocab_file)
    build_train_valid_test_datasets(data_config, tokenizer, num_samples, seed, binary_head)
    build_pretraining_data_loader(dataset, consumed_samples, micro_batch_size, dp_rank, dp_size, num_workers)
"""
from megabert.data.bert_dataset import BertDataset, SampleSpec
from megabert.data.dataset_builder import BlendedDataset, build_train_valid_test_datasets
from megabert.data.indexed_dataset import IndexedDataset, IndexedDatasetWriter
from megabert.data.sample_mapping import DataWarning
from megabert.data.samplers import PretrainingSampler, build_pretraining_data_loader
from megabert.data.tokenizers import Tokenizer, build_tokenizer

__all__ = ["build_tokenizer", "build_train_valid_test_datasets", "build_pretraining_data_loader", "Tokenizer",
           "IndexedDataset", "IndexedDatasetWriter", "BertDataset", "SampleSpec", "BlendedDataset",
           "PretrainingSampler", "DataWarning"]
