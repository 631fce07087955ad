"""finetune_squad.py's own flags: the data files, features (as Google's run_squad /
transformers' run_qa) and answers. The flags every task has come from megabert.config's
TaskConfig, the shared parallel, optimizer and training flags from its other sections."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megabert.config import TaskConfig, arg
from megabert.errors import ConfigError


@dataclass(kw_only=True)
class SquadConfig(TaskConfig):
    """SQuAD fine-tuning: data files, features (as Google's run_squad / transformers' run_qa) and answers."""

    train_file: Optional[str] = arg(None, "SQuAD json to fine-tune on (omit to predict only).")
    predict_file: Optional[str] = arg(None, "SQuAD json to predict and score (omit to train only).")
    output_dir: Optional[str] = arg(None, "Where predictions.json, nbest_predictions.json and eval_results.json go.")
    version_2_with_negative: bool = arg(False, "SQuAD 2.0: questions may have no answer ([CLS] = no answer).")
    max_seq_length: int = arg(384, "Tokens per feature: [CLS] question [SEP] context window [SEP], padded.")
    doc_stride: int = arg(128, "Overlap in tokens between consecutive context windows (transformers' stride).")
    max_query_length: int = arg(64, "Questions are cut to this many tokens.")
    epochs: float = arg(2.0, "Passes over the training features (may be fractional).")
    n_best_size: int = arg(20, "Start and end candidates per window; answers kept in nbest_predictions.json.")
    max_answer_length: int = arg(30, "Longest answer in tokens.")
    null_score_diff_threshold: float = arg(0.0, "SQuAD 2.0: predict no answer when the null score exceeds the "
                                           "best span's score by more than this.")

    def __post_init__(self):
        super().__post_init__()
        if not self.train_file and not self.predict_file:
            raise ConfigError("give --train-file, --predict-file or both")
        if self.predict_file and not self.output_dir:
            raise ConfigError("--predict-file needs --output-dir for predictions.json and eval_results.json")
        for name in ("max_query_length", "n_best_size", "max_answer_length"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        window = self.max_seq_length - self.max_query_length - 3
        if not 0 <= self.doc_stride < window:
            raise ConfigError(f"--doc-stride {self.doc_stride} must be in [0, {window}): a context window holds "
                              f"--max-seq-length {self.max_seq_length} - --max-query-length {self.max_query_length} "
                              f"- 3 tokens at least")
