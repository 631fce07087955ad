"""Sentence embeddings for retrieval: a bi-encoder (one BERT or ModernBERT for queries and
passages) trained contrastively with in-batch and hard negatives from the whole global batch, scored on a
BEIR-layout dev set and exported as a sentence-transformers model; EmbeddingsTask is what
the fine-tuning driver (megabert.training.finetune) runs for finetune_embeddings.py."""
from megabert.tasks.embeddings.model import BertForSentenceEmbedding, EmbeddingOutput, ModernBertForSentenceEmbedding

__all__ = ["BertForSentenceEmbedding", "EmbeddingOutput", "ModernBertForSentenceEmbedding"]
