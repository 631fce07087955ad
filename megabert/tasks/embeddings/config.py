"""finetune_embeddings.py's own flags: the training pairs, the BEIR dev dir, the embedding
(pooling, normalisation), the contrastive loss and the gradient cache. The flags every task
has come from megabert.config's TaskConfig, the parallel, optimizer and training flags from
its other sections."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megabert.config import TaskConfig, arg
from megabert.errors import ConfigError

# The recipe of sentence-transformers' trainer and of most BERT retrievers trained with
# in-batch negatives (SBERT, E5, GTE fine-tuning stages): AdamW, lr 2e-5, 10% linear warm-up
# then linear decay, weight decay 0.01.
EMBEDDINGS_DEFAULTS = {"optim.lr": 2e-5, "optim.lr_warmup_fraction": 0.1, "optim.lr_decay_style": "linear",
                       "optim.weight_decay": 0.01}


@dataclass(kw_only=True)
class EmbeddingsConfig(TaskConfig):
    """Sentence-embedding fine-tuning: (query, positive, hard negatives) pairs, a BEIR dev set, the export."""

    train_file: Optional[str] = arg(None, "JSON lines {\"query\": .., \"positive\": .., \"negative\": .. (optional: a "
                                    "string or a list)}, sentence-transformers' (anchor, positive, negative) layout.")
    eval_dir: Optional[str] = arg(None, "A BEIR-layout dir to score: corpus.jsonl (_id, title, text), queries.jsonl "
                                  "(_id, text), qrels/dev.tsv (query-id, corpus-id, score; a header line).")
    output_dir: Optional[str] = arg(None, "Where eval_results.json and sentence-transformers/ (the model as "
                                    "sentence_transformers.SentenceTransformer loads it) go.")
    max_seq_length: int = arg(128, "Tokens per text ([CLS] text [SEP]), queries and passages alike; longer ones cut.")
    epochs: float = arg(1.0, "Passes over the training pairs (may be fractional).")
    pooling: str = arg("mean", "How a text's token vectors become its embedding: the mean over its tokens "
                       "(padding excluded), or the [CLS] token's vector.", choices=("mean", "cls"))
    normalize: bool = arg(True, "L2-normalise embeddings, so similarity is the cosine (--no-normalize: dot product).")
    temperature: float = arg(0.05, "InfoNCE temperature: similarities are divided by it (0.05 = "
                             "sentence-transformers' scale 20).")
    embedding_chunk_size: Optional[int] = arg(
        None, "Gradient cache (Gao et al. 2021): embed each micro-batch in chunks of this many examples without "
        "keeping activations, take the loss and its gradients on the embeddings, then re-run and backpropagate one "
        "chunk at a time. Loss and gradients are the uncached ones; memory is one chunk's. Must divide "
        "--micro-batch-size.")

    def __post_init__(self):
        super().__post_init__()
        if not self.train_file and not self.eval_dir:
            raise ConfigError("give --train-file, --eval-dir or both")
        if (self.eval_dir or self.train_file) and not self.output_dir:
            raise ConfigError("--output-dir is required: eval_results.json and sentence-transformers/ go there")
        if not self.temperature > 0:
            raise ConfigError(f"--temperature must be positive, got {self.temperature}")
        if self.embedding_chunk_size is not None and self.embedding_chunk_size < 1:
            raise ConfigError(f"--embedding-chunk-size must be >= 1, got {self.embedding_chunk_size}")
