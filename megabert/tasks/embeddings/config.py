"""finetune_embeddings.py's own flags: the training pairs, the BEIR dev dir, the embedding
(prompts, lengths, pooling, normalisation: shared with tools/mine_hard_negatives.py), the
contrastive loss (Matryoshka), the gradient cache and evaluation during training. The flags every task
has come from megabert.config's TaskConfig, the parallel, optimizer and training flags from
its other sections."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megabert.config import TaskConfig
from megabert.config_fields import arg, check_at_least
from megabert.errors import ConfigError

# The recipe of sentence-transformers' trainer and of most BERT retrievers trained with
# in-batch negatives (SBERT, E5, GTE fine-tuning stages): AdamW, lr 2e-5, 10% linear warm-up
# then linear decay, weight decay 0.01.
EMBEDDINGS_DEFAULTS = {"optim.lr": 2e-5, "optim.lr_warmup_fraction": 0.1, "optim.lr_decay_style": "linear",
                       "optim.weight_decay": 0.01}


@dataclass(kw_only=True)
class TextEmbeddingConfig(TaskConfig):
    """How texts become embeddings, in training, evaluation and mining alike: prompts, lengths,
    pooling and normalisation (EmbeddingsConfig and tools/mine_hard_negatives.py's
    MiningConfig)."""

    max_seq_length: int = arg(128, "Tokens per text ([CLS] text [SEP]), queries and passages alike; longer ones cut.")
    query_max_length: Optional[int] = arg(None, "Tokens per query (prompt included); default --max-seq-length, "
                                          "at most it.")
    document_max_length: Optional[int] = arg(None, "Tokens per positive, negative or corpus passage (prompt "
                                             "included); default --max-seq-length, at most it.")
    query_prompt: str = arg("", "Put before every query in training, evaluation and mining (E5's \"query: \"); the "
                            "export saves it as the prompt named query.")
    document_prompt: str = arg("", "Put before every positive, negative and passage (E5's \"passage: \"); the "
                               "export saves it as the prompt named document.")
    pooling: str = arg("mean", "How a text's token vectors become its embedding: the mean over its tokens "
                       "(padding excluded), or the [CLS] token's vector.", choices=("mean", "cls"))
    normalize: bool = arg(True, "L2-normalise embeddings, so similarity is the cosine (--no-normalize: dot product).")

    def __post_init__(self):
        super().__post_init__()
        check_at_least(self, 1, "query_max_length", "document_max_length")
        for name in ("query_max_length", "document_max_length"):
            value = getattr(self, name)
            if value is not None and value > self.max_seq_length:
                raise ConfigError(f"--{name.replace('_', '-')} {value} exceeds --max-seq-length "
                                  f"{self.max_seq_length}; raise --max-seq-length (every text is padded to it)")

    @property
    def query_length(self) -> int:
        return self.query_max_length or self.max_seq_length

    @property
    def document_length(self) -> int:
        return self.document_max_length or self.max_seq_length


@dataclass(kw_only=True)
class EmbeddingsConfig(TextEmbeddingConfig):
    """Sentence-embedding fine-tuning: (query, positive, hard negatives) pairs, a BEIR dev set, the export."""

    train_file: Optional[list] = arg(None, "JSON lines {\"query\": .., \"positive\": .., \"negative\": .. (optional: "
                                     "a string or a list)}, sentence-transformers' (anchor, positive, negative) "
                                     "layout; several files: each global batch comes from one of them.")
    dataset_sampling: str = arg("proportional", "With several --train-file: which file each global batch comes from: "
                                "drawn at random in proportion to the files' sizes (or --dataset-weights), or each "
                                "file in turn.", choices=("proportional", "round_robin"))
    dataset_weights: Optional[str] = arg(None, "With --dataset-sampling proportional: one weight per --train-file, "
                                         "comma-separated (default the files' numbers of pairs).")
    duplicates: bool = arg(True, "A text may come twice in a global batch. --no-duplicates: never (every DP rank and "
                           "micro-batch; as query, positive or negative): a pair that repeats a text already in the "
                           "batch waits for a later one (sentence-transformers' NO_DUPLICATES), so a copy is never "
                           "a false negative.")
    eval_dir: Optional[str] = arg(None, "A BEIR-layout dir to score: corpus.jsonl (_id, title, text), queries.jsonl "
                                  "(_id, text), qrels/dev.tsv (query-id, corpus-id, score; a header line).")
    output_dir: Optional[str] = arg(None, "Where eval_results.json and sentence-transformers/ (the model as "
                                    "sentence_transformers.SentenceTransformer loads it) go.")
    epochs: float = arg(1.0, "Passes over the training pairs (may be fractional).")
    temperature: float = arg(0.05, "InfoNCE temperature: similarities are divided by it (0.05 = "
                             "sentence-transformers' scale 20).")
    embedding_chunk_size: Optional[int] = arg(
        None, "Gradient cache (Gao et al. 2021): embed each micro-batch in chunks of this many examples without "
        "keeping activations, take the loss and its gradients on the embeddings, then re-run and backpropagate one "
        "chunk at a time. Loss and gradients are the uncached ones; memory is one chunk's. Must divide "
        "--micro-batch-size.")
    matryoshka_dims: Optional[str] = arg(None, "Matryoshka representation learning (Kusupati et al. 2022): the loss "
                                         "is the weighted sum of the InfoNCE losses of the embeddings cut to each of "
                                         "these sizes (comma-separated, e.g. 768,512,256,128,64) and re-normalised; "
                                         "eval_results.json scores every size.")
    matryoshka_weights: Optional[str] = arg(None, "One weight per --matryoshka-dims size (default 1 each).")
    eval_interval: Optional[int] = arg(None, "Score --eval-dir every this many steps (and at the end).")
    keep_best: Optional[str] = arg(None, "With --eval-interval: the export (and eval_results.json) is the "
                                   "evaluated model with the highest value of this metric, not the last.",
                                   choices=(None, "ndcg_at_10", "mrr_at_10", "recall_at_10", "recall_at_100"))

    def __post_init__(self):
        super().__post_init__()
        if not self.train_file and not self.eval_dir:
            raise ConfigError("give --train-file, --eval-dir or both")
        if (self.eval_dir or self.train_file) and not self.output_dir:
            raise ConfigError("--output-dir is required: eval_results.json and sentence-transformers/ go there")
        if not self.temperature > 0:
            raise ConfigError(f"--temperature must be positive, got {self.temperature}")
        check_at_least(self, 1, "embedding_chunk_size", "eval_interval")
        dims = self.matryoshka()
        if self.matryoshka_weights is not None and dims is None:
            raise ConfigError("--matryoshka-weights needs --matryoshka-dims")
        files = self.train_file or []
        if self.dataset_weights is not None:
            if self.dataset_sampling != "proportional":
                raise ConfigError("--dataset-weights weighs --dataset-sampling proportional; round_robin takes each "
                                  "--train-file in turn")
            weights = number_list(self.dataset_weights, "--dataset-weights", float)
            if len(weights) != len(files) or min(weights) <= 0:
                raise ConfigError(f"--dataset-weights needs one positive weight per --train-file ({len(files)}), "
                                  f"got {self.dataset_weights!r}")
        if self.keep_best is not None and not (self.eval_interval and self.eval_dir):
            raise ConfigError("--keep-best needs --eval-interval and --eval-dir (the metric is scored on it)")
        if self.eval_interval is not None and not (self.eval_dir and self.train_file):
            raise ConfigError("--eval-interval scores --eval-dir while training on --train-file: give both")

    def matryoshka(self) -> Optional[tuple[tuple[int, ...], tuple[float, ...]]]:
        """(dims, weights) of --matryoshka-dims / --matryoshka-weights, or None."""
        if self.matryoshka_dims is None:
            return None
        dims = tuple(number_list(self.matryoshka_dims, "--matryoshka-dims", int))
        if min(dims) < 1 or len(set(dims)) != len(dims):
            raise ConfigError(f"--matryoshka-dims takes distinct positive sizes, got {self.matryoshka_dims!r}")
        if self.matryoshka_weights is None:
            return dims, (1.0,) * len(dims)
        weights = tuple(number_list(self.matryoshka_weights, "--matryoshka-weights", float))
        if len(weights) != len(dims):
            raise ConfigError(f"--matryoshka-weights has {len(weights)} weights for {len(dims)} --matryoshka-dims")
        return dims, weights


def number_list(text: str, flag: str, kind: type) -> list:
    """"768,512" -> [768, 512]; a one-line error naming the flag otherwise."""
    try:
        return [kind(part) for part in text.split(",")]
    except ValueError:
        raise ConfigError(f"{flag} takes comma-separated {kind.__name__}s, got {text!r}") from None
