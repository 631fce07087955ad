"""finetune_glue.py's own flags: the task, its files, the features and what to run. The
flags every task has come from megabert.config's TaskConfig (--pack-sequences from its
PackedTaskConfig), the shared parallel, optimizer and training flags from its other sections."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megabert.config import PackedTaskConfig, arg
from megabert.errors import ConfigError
from megabert.tasks.glue.tasks import ALIASES, TASKS

# BERT's GLUE recipe (Devlin et al. 2019; Google's run_classifier.py, NVIDIA's run_glue.py):
# AdamW with 10% linear warmup then linear decay to 0, weight decay 0.01, lr 2e-5 (the
# paper's grid is 5e-5, 3e-5, 2e-5), 3 epochs at sequence length 128 (GlueConfig's defaults).
GLUE_DEFAULTS = {"optim.lr": 2e-5, "optim.lr_warmup_fraction": 0.1, "optim.lr_decay_style": "linear",
                 "optim.weight_decay": 0.01}


@dataclass(kw_only=True)
class GlueConfig(PackedTaskConfig):
    """GLUE fine-tuning: the task, its data (the distribution's TSVs or CSV / JSON-lines files) and outputs."""

    task_name: str = arg(None, "The GLUE task (run_glue.py's sst2 and stsb are accepted too).",
                         choices=tuple(TASKS) + tuple(ALIASES))
    data_dir: Optional[str] = arg(None, "The task's folder of the GLUE distribution: train.tsv, dev.tsv (MNLI: "
                                  "dev_matched.tsv, dev_mismatched.tsv), test.tsv (MNLI: test_matched.tsv, "
                                  "test_mismatched.tsv), read as they are.")
    train_file: Optional[str] = arg(None, "Training data instead of --data-dir's: a GLUE TSV, or a .csv / .json "
                                    "(JSON lines) with a label column and one or two sentence columns "
                                    "(sentence1, sentence2), as run_glue.py's --train_file.")
    validation_file: Optional[str] = arg(None, "Dev data instead of --data-dir's (TSV, .csv or .json).")
    test_file: Optional[str] = arg(None, "Test data to predict instead of --data-dir's (TSV, .csv or .json; "
                                   "labels not needed).")
    output_dir: Optional[str] = arg(None, "Where eval_results.json and the GLUE submission files ({TASK}.tsv) go.")
    max_seq_length: int = arg(128, "Tokens per feature: [CLS] A [SEP] (B [SEP]), longer pairs truncated, padded.")
    do_train: bool = arg(True, "Fine-tune on the training data (--no-do-train: evaluate / predict --load as it is).")
    do_eval: bool = arg(True, "Score the dev set(s) into eval_results.json.")
    do_predict: bool = arg(True, "Write GLUE submission files for the test set(s) that exist.")

    def __post_init__(self):
        super().__post_init__()
        if self.task_name is None:
            raise ConfigError(f"--task-name is required: one of {', '.join(TASKS)}")
        self.task_name = ALIASES.get(self.task_name.lower(), self.task_name.lower())
        if not (self.do_train or self.do_eval or self.do_predict):
            raise ConfigError("--no-do-train, --no-do-eval and --no-do-predict leave nothing to do")
        if self.do_train and not (self.data_dir or self.train_file):
            raise ConfigError("training needs --data-dir (its train.tsv) or --train-file; --no-do-train to "
                              "evaluate only")
        if self.do_eval and not (self.data_dir or self.validation_file):
            raise ConfigError("evaluation needs --data-dir (its dev.tsv) or --validation-file; --no-do-eval to skip it")
        if (self.do_eval or self.do_predict) and not self.output_dir:
            raise ConfigError("--output-dir is required for eval_results.json and the submission files "
                              "(or --no-do-eval --no-do-predict)")
