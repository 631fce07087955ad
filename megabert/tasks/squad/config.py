"""finetune_squad.py's own flags: the data files, features (as Google's run_squad /
transformers' run_qa) and answers. The shared parallel, optimizer and training flags come
from megabert.config."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megabert.config import arg
from megabert.errors import ConfigError


@dataclass(kw_only=True)
class SquadConfig:
    """SQuAD fine-tuning: data files, features (as Google's run_squad / transformers' run_qa) and answers."""

    train_file: Optional[str] = arg(None, "SQuAD json to fine-tune on (omit to predict only).")
    predict_file: Optional[str] = arg(None, "SQuAD json to predict and score (omit to train only).")
    output_dir: Optional[str] = arg(None, "Where predictions.json, nbest_predictions.json and eval_results.json go.")
    vocab_file: Optional[str] = arg(None, "WordPiece vocab.txt (or tokenizer.json); default vocab.txt in a "
                                    "Hugging Face --load directory.")
    tokenizer_type: str = arg("BertWordPieceLowerCase", "Tokenizer type (lower-cased or cased WordPiece, or a "
                              "tokenizer.json); must match the pre-trained model.",
                              choices=("BertWordPieceLowerCase", "BertWordPieceCase", "HuggingFaceTokenizer"))
    version_2_with_negative: bool = arg(False, "SQuAD 2.0: questions may have no answer ([CLS] = no answer).")
    max_seq_length: int = arg(384, "Tokens per feature: [CLS] question [SEP] context window [SEP], padded.")
    doc_stride: int = arg(128, "Overlap in tokens between consecutive context windows (transformers' stride).")
    max_query_length: int = arg(64, "Questions are cut to this many tokens.")
    epochs: float = arg(2.0, "Passes over the training features (may be fractional).")
    train_iters: Optional[int] = arg(None, "Optimizer steps; default --epochs over the training features.")
    n_best_size: int = arg(20, "Start and end candidates per window; answers kept in nbest_predictions.json.")
    max_answer_length: int = arg(30, "Longest answer in tokens.")
    null_score_diff_threshold: float = arg(0.0, "SQuAD 2.0: predict no answer when the null score exceeds the "
                                           "best span's score by more than this.")
    predict_batch_size: Optional[int] = arg(None, "Features per forward pass when predicting; default "
                                            "--micro-batch-size.")

    def __post_init__(self):
        if not self.train_file and not self.predict_file:
            raise ConfigError("give --train-file, --predict-file or both")
        if self.predict_file and not self.output_dir:
            raise ConfigError("--predict-file needs --output-dir for predictions.json and eval_results.json")
        for name in ("max_query_length", "n_best_size", "max_answer_length"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.max_seq_length < 8:
            raise ConfigError(f"--max-seq-length must be at least 8, got {self.max_seq_length}")
        window = self.max_seq_length - self.max_query_length - 3
        if not 0 <= self.doc_stride < window:
            raise ConfigError(f"--doc-stride {self.doc_stride} must be in [0, {window}): a context window holds "
                              f"--max-seq-length {self.max_seq_length} - --max-query-length {self.max_query_length} "
                              f"- 3 tokens at least")
        if self.epochs <= 0:
            raise ConfigError(f"--epochs must be positive, got {self.epochs}")
        if self.train_iters is not None and self.train_iters < 1:
            raise ConfigError(f"--train-iters must be >= 1, got {self.train_iters}")
        if self.predict_batch_size is not None and self.predict_batch_size < 1:
            raise ConfigError(f"--predict-batch-size must be >= 1, got {self.predict_batch_size}")
