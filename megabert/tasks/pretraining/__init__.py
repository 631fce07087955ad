"""BERT pre-training (masked LM + SOP/NSP): samples built from Megatron's indexed dataset or
read from NVIDIA's HDF5 / LDDL parquet shards, the BertForPreTraining model, its loss and
evaluation counts, and the task that pretrain_bert.py runs on the driver (task.py)."""
from megabert.tasks.pretraining.model import BertForPreTraining, BertPreTrainingOutput
from megabert.tasks.pretraining.nvidia_samples import pretraining_samples

__all__ = ["BertForPreTraining", "BertPreTrainingOutput", "pretraining_samples"]
