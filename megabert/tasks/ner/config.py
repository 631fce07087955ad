"""finetune_ner.py's own flags: the data files, the labels and the windows. The flags every
task has come from megabert.config's TaskConfig (--pack-sequences from its PackedTaskConfig),
the shared parallel, optimizer and training flags from its other sections."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megabert.arguments import FINETUNE_DEFAULTS
from megabert.config import PackedTaskConfig, arg
from megabert.errors import ConfigError
from megabert.tasks.ner.features import PREDICT_WINDOWS, TRAIN_WINDOWS

# BERT's fine-tuning recipe (warmup, linear decay, weight decay) at run_ner.py's learning
# rate (TrainingArguments' 5e-5; BERT's paper tunes NER within 2e-5..5e-5). AdamW eps 1e-6 and
# weight decay 0.01 stay against Trainer's 1e-8 and 0: +0.24 F1 within noise on the bench's
# default set, -1.1 on its harder one (docs/performance.md, issue 52).
NER_DEFAULTS = {**FINETUNE_DEFAULTS, "optim.lr": 5e-5}


@dataclass(kw_only=True)
class NerConfig(PackedTaskConfig):
    """Token classification (NER): CoNLL or JSON-lines files, the tags as they come (IOB1, IOB2, IOBES)."""

    train_file: Optional[str] = arg(None, "Tagged sentences to fine-tune on: CoNLL (token per line, tag in the last "
                                    "column, blank line between sentences) or JSON lines (.json/.jsonl: "
                                    "{\"tokens\": [...], \"ner_tags\": [...]}); its tags are the label set.")
    validation_file: Optional[str] = arg(None, "Tagged sentences to score into eval_results.json (same formats).")
    test_file: Optional[str] = arg(None, "Sentences to tag into predictions.txt (same formats; tags not needed).")
    output_dir: Optional[str] = arg(None, "Where eval_results.json and predictions.txt go.")
    label_all_tokens: bool = arg(False, "Label every sub-word of a word with its tag (B-X as I-X after the first), "
                                 "not the first alone; predictions still read each word's first sub-word.")
    train_windows: str = arg("weighted", "Sentences longer than --max-seq-length - 2 sub-words, in training: each word "
                             "labelled in every window that holds it, weighted so that it counts once in the loss "
                             "(weighted); in the window where it sits most central alone (owned); in every window at "
                             "full weight (all: the overlaps count several times); or in the first window alone "
                             "(first: run_ner.py's truncation; later words are still predicted).",
                             choices=TRAIN_WINDOWS)
    predict_windows: str = arg("mean", "Sentences longer than --max-seq-length - 2 sub-words, in prediction: each "
                               "word's tag probabilities averaged over every window that holds it (mean), or read in "
                               "the window where it sits most central (max-context, SQuAD's rule).",
                               choices=PREDICT_WINDOWS)
    stride: Optional[int] = arg(None, "Sub-words each window of a sentence longer than --max-seq-length - 2 shares "
                                "with the window before (transformers' stride); default three quarters of a window, so "
                                "that a word is read in about four windows (--predict-windows mean).")

    def __post_init__(self):
        super().__post_init__()
        if not (self.train_file or self.validation_file or self.test_file):
            raise ConfigError("give --train-file, --validation-file, --test-file or several")
        if (self.validation_file or self.test_file) and not self.output_dir:
            raise ConfigError("--validation-file and --test-file need --output-dir for eval_results.json and "
                              "predictions.txt")
        window = self.max_seq_length - 2
        if self.stride is not None and not 0 <= self.stride < window:
            raise ConfigError(f"--stride {self.stride} must be in [0, {window}): a window holds --max-seq-length "
                              f"{self.max_seq_length} - 2 sub-words")
