"""BERT pre-training as a task of the driver (megabert.training.driver), as pretrain_bert.py
runs it: the TrainingTask (inputs, loss, evaluation counts), the host-side positions its
batches carry, the model built from the flags, and PretrainingTask, which hands them over."""
from __future__ import annotations

import dataclasses
import logging
import math
from typing import Callable, Iterable, Iterator, Optional

import torch

from megabert.arguments import Cli
from megabert.checkpoint.run_state import TrainingState
from megabert.config import Configs, DataConfig
from megabert.errors import ConfigError
from megabert.data.packing import with_flat_label_positions, with_flat_token_positions, with_label_positions
from megabert.families import get_family, task_class_name
from megabert import model_classes
from megabert.model.packed import fixed_shape_packing
from megabert.model_family import model_vocab_size
from megabert.planning import log_preflight
from megabert.tasks.pretraining import BertPreTrainingOutput
from megabert.tasks.pretraining.batches import build_batches
from megabert.tasks.pretraining.masking import MaskRates
from megabert.parallel import ParallelState
from megabert.tensor_parallel.random import seed_default_stream
from megabert.training.build import apply_compile
from megabert.training.driver import Task, Training, trainer_for
from megabert.planning.flops import bert_flops_per_sample
from megabert.training.resolve import ResolvedRun
from megabert.training.strategy import Counts, TrainingTask
from megabert.training.trainer import Trainer

logger = logging.getLogger(__name__)


PRETRAINING_INPUTS = ("input_ids", "token_type_ids", "attention_mask", "labels", "next_sentence_label")
# Packed rows only (megabert.data.packing), but the positions pretraining_batches adds on the host
# (mlm_positions to packed rows; mlm_flat_positions and token_positions to unpacked ones).
PACKED_INPUTS = ("position_ids", "packed_seqlens", "mlm_positions", "mlm_flat_positions", "token_positions")


def mlm_slots_per_row(data: DataConfig) -> int:
    """The masked positions a packed row has room for (NVIDIA's max_predictions_per_seq, for a
    row). A sample of n tokens gets max(1, round(--mask-prob x n)) masked positions at most
    (megabert's masking, NVIDIA's create_pretraining_data.py and LDDL alike), which is at most
    --mask-prob x n + 1; a row's samples hold at most --seq-length tokens together, so a row
    holds at most floor(--mask-prob x --seq-length) + --max-samples-per-row (the highest rate of
    --mask-prob-schedule, if higher). With
    --max-predictions-per-seq, a sample holds no more than that."""
    samples = data.max_samples_per_row
    slots = math.floor(data.highest_mask_prob * data.seq_length + 1e-9) + samples
    if data.max_predictions_per_seq is not None:
        slots = min(slots, samples * data.max_predictions_per_seq)
    return min(slots, data.seq_length)


def pretraining_batches(batches: Iterable[dict], run: ResolvedRun, device: torch.device) -> Iterable[dict]:
    """BERT's micro-batches get, computed on the host, the positions the model would otherwise
    find with a nonzero() on the device (a host sync on a GPU):
    - with logits at the masked positions only, the masked positions, which the head reads
      instead of selecting `labels != -100` with a bool mask (four syncs per micro-batch with
      their backward):
      - packed rows, where they run the fixed-shape step (megabert.model.packed.fixed_shape_packing):
        `mlm_positions` [rows, mlm_slots_per_row], so that every tensor of the step has a shape the
        flags fix (CUDA graphs, one compilation);
      - unpacked rows, on every device: `mlm_flat_positions` [n], row x seq + column of each of
        the micro-batch's n masked positions (with_flat_label_positions): n follows the data but
        the host knows it, and the head computes no empty slot;
    - unpacked rows with the unpadded encoder: `token_positions` [T], row x seq + column of each
      real token (with_flat_token_positions), which megabert.model.unpad.TokenLayout takes
      instead of the mask's nonzero(). The unpacked step then waits for the device nowhere.
    A family whose masked LM has no packed rows' slots (Family.packed_mlm_slots False) takes the unpacked rows' two (its packed rows select on the device)."""
    data = run.data
    if data.pack_sequences and not get_family(run.model.model_family).packed_mlm_slots:
        return batches
    if data.pack_sequences:
        if not (run.model.mlm_logits_at_masked_only and fixed_shape_packing(device, run.model.unpad_input)):
            return batches
        too_many = (f"the samples were masked at a higher rate than --mask-prob {data.mask_prob} (NVIDIA shards' "
                    f"masks are used as stored): pass the rate they were masked with as --mask-prob")
        return with_label_positions(batches, mlm_slots_per_row(data), "mlm_positions", too_many)
    if run.model.mlm_logits_at_masked_only:
        batches = with_flat_label_positions(batches, "mlm_flat_positions")
    if run.model.unpad_input:
        batches = with_flat_token_positions(batches, "token_positions")
    return batches


def pretraining_task(binary_head_task: Optional[str], mask_rates: Optional[MaskRates] = None) -> TrainingTask:
    """BertPreTrainingOutput -> (loss, {"lm_loss", "sop_loss"|"nsp_loss"}); at evaluation
    also the counts behind "lm_accuracy" and "sop_accuracy"|"nsp_accuracy". With `mask_rates`,
    each metrics line carries the masking rate of the step's last sample ("mask_prob")."""

    def output_loss(out):
        metrics = {"lm_loss": out.mlm_loss}
        if binary_head_task and out.nsp_loss is not None:
            metrics[f"{binary_head_task}_loss"] = out.nsp_loss
        return out.loss, metrics

    def output_counts(out) -> Counts:
        counts = {"lm_accuracy": masked_lm_counts(out)}
        if binary_head_task and out.nsp_logits is not None and out.nsp_labels is not None:
            counts[f"{binary_head_task}_accuracy"] = sentence_pair_counts(out)
        return counts

    # The MLM loss is a mean over the global batch's masked tokens, the sentence-pair loss over
    # its samples (TrainingTask.loss_counts): a step's loss and gradients then depend on which samples it
    # holds, not on how micro-batches, data-parallel ranks or packed rows group them.
    def loss_counts(batch: dict) -> torch.Tensor:
        masked = (batch["labels"] != -100).sum()
        label = batch.get("next_sentence_label")
        samples = (label != -100).sum() if binary_head_task and label is not None else torch.zeros_like(masked)
        return torch.stack([masked, samples])

    def global_loss(out, shares: torch.Tensor):
        mlm_sum, nsp_sum = out.mlm_loss_sum, out.nsp_loss_sum
        lm = mlm_sum / shares[0]
        metrics = {"lm_loss": lm}
        if binary_head_task and nsp_sum is not None:
            metrics[f"{binary_head_task}_loss"] = nsp = nsp_sum / shares[1]
            return lm + nsp, metrics
        return lm, metrics

    inputs = PRETRAINING_INPUTS if binary_head_task else PRETRAINING_INPUTS[:-1]
    log_fields = (None if mask_rates is None else
                  (lambda consumed: {"mask_prob": mask_rates.for_sample(max(consumed - 1, 0))}))
    return TrainingTask(inputs=inputs + PACKED_INPUTS, output_loss=output_loss, output_counts=output_counts,
                        loss_counts=loss_counts, global_loss=global_loss, log_fields=log_fields)


def masked_lm_counts(out: BertPreTrainingOutput) -> torch.Tensor:
    """tensor([correct, masked]): masked positions (label != -100) whose argmax over the
    full vocab is the label, and their number. MLPerf judges BERT by this ratio (72.0%)."""
    labels = out.mlm_labels
    masked = labels != -100
    correct = (out.mlm_predictions == labels) & masked
    return torch.stack([correct.sum(), masked.sum()])


def sentence_pair_counts(out: BertPreTrainingOutput) -> torch.Tensor:
    """tensor([correct, samples]) of the binary (SOP/NSP) head's argmax (-100: an empty slot
    of a packed row)."""
    labels = out.nsp_labels
    correct = out.nsp_logits.argmax(dim=-1) == labels
    return torch.stack([correct.sum(), (labels != -100).sum()])


class PretrainingTask(Task):
    """pretrain_bert.py's task for the driver (megabert.training.driver): BERT samples of
    --data-path (Megatron's indexed dataset, NVIDIA's HDF5 or LDDL parquet shards), a model
    built from the flags or continued from --load, masked LM + SOP/NSP."""

    name = "pre-training"
    cli = Cli()

    def __init__(self, run: ResolvedRun):
        if not run.data.data_path:
            raise ConfigError("--data-path is required: a dataset prefix made by tools/preprocess_data.py")
        # A run that starts from a checkpoint without a tokenizer.json beside it (the model's
        # family adopts one) needs --vocab-file, which a missing-vocab error of the WordPiece
        # reader would not say.
        if run.data.vocab_file is None and run.start.source is not None:
            raise ConfigError(f"--vocab-file (or --tokenizer-model) is required: pre-training takes only a "
                              f"tokenizer.json from beside --load, and {run.start.source.directory} has none; "
                              f"pass the tokenizer the model was trained with")
        self.batches: Optional[tuple] = None

    @classmethod
    def for_run(cls, cfg: Configs, run: ResolvedRun) -> "PretrainingTask":
        return cls(run)

    def prepare(self, run: ResolvedRun, ps: ParallelState, tokenizer) -> None:
        """The planner's predicted peak against --memory-budget-gb, then this rank's loaders."""
        if ps.is_logging_rank:
            log_preflight(run, ps.device, vocab_size=tokenizer.vocab_size)
        self.batches = build_batches(run, ps, tokenizer)

    def build_model(self, run: ResolvedRun, ps: ParallelState, vocab_size: int) -> torch.nn.Module:
        return pretraining_model(run, ps, vocab_size)

    def training(self, run: ResolvedRun, ps: ParallelState, model: torch.nn.Module, tokenizer) -> Training:
        return pretraining_training(run, ps, model, *self.batches)

    def finish(self, run: ResolvedRun, ps: ParallelState, model: torch.nn.Module, tokenizer,
               state: Optional[TrainingState]) -> None:
        if ps.is_logging_rank:
            print(f"done: iteration {state.iteration}, {state.consumed_samples} samples", flush=True)


def pretraining_model(run: ResolvedRun, ps: ParallelState, vocab_size: int) -> torch.nn.Module:
    """This rank's BertForPreTraining or ModernBertForMaskedLM (its pipeline stage), as the
    resolved run describes it, its vocab at least the tokenizer's `vocab_size`."""
    model_cfg = dataclasses.replace(run.model, vocab_size=model_vocab_size(run.model, run.explicit, vocab_size))
    seed_default_stream(run.train.seed, ps.pp_rank, ps.device)
    model_class = model_classes.by_name(task_class_name(model_cfg, "pretraining"))
    model = model_class(model_cfg, ps, seed=run.train.seed,
                        num_layers_per_virtual_stage=run.parallel.num_layers_per_virtual_pipeline_stage,
                        first_stage_layers=run.parallel.decoder_first_pipeline_num_layers,
                        last_stage_layers=run.parallel.decoder_last_pipeline_num_layers)
    apply_compile(model, ps, run.train, fixed_shapes=run.data.pack_sequences)
    return model


def pretraining_training(run: ResolvedRun, ps: ParallelState, model: torch.nn.Module,
                         train_batches: Callable[[int], Iterator[dict]],
                         valid_batches: Optional[Callable[[], Iterator[dict]]] = None) -> Training:
    """`model` trains on these batches with the masked-LM (+ SOP/NSP) loss for --train-iters."""
    masked = int(round(run.data.mask_prob * run.seq_length)) if model.config.mlm_logits_at_masked_only else None
    train = lambda consumed: pretraining_batches(train_batches(consumed), run, ps.device)  # noqa: E731
    valid = (lambda: pretraining_batches(valid_batches(), run, ps.device)) if valid_batches is not None else None
    task = pretraining_task(run.binary_head_task, MaskRates.of(run.data, run.batch.global_batch_size))
    return Training(task, run.train.train_iters, train, valid,
                    flops_per_sample=bert_flops_per_sample(model.config, run.seq_length, masked))


def build_pretraining(run: ResolvedRun, ps: ParallelState, vocab_size: int,
                      train_batches: Callable[[int], Iterator[dict]],
                      valid_batches: Optional[Callable[[], Iterator[dict]]] = None) -> Trainer:
    """The model and the ready Trainer (optimizer, update strategy, ours or DeepSpeed's, and
    checkpoint state) that the driver builds for pretrain_bert.py, on these batches."""
    model = pretraining_model(run, ps, vocab_size)
    return trainer_for(run, ps, model, pretraining_training(run, ps, model, train_batches, valid_batches))
