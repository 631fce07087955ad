"""`from_pretrained` (Hugging Face dir or megabert checkpoint of any layout), loading a
rank's state dict into its slice of a model, full-state gathering and Hugging Face export."""
from __future__ import annotations

import dataclasses

import logging
from typing import Optional, Union

import torch

from megabert.checkpoint import hf as hf_io
from megabert.checkpoint.reader import RankCheckpoint, as_source, read_model_config, read_rank
from megabert.checkpoint.start import Source
from megabert.config import ModelConfig
from megabert.errors import CheckpointError, ConfigError
from megabert.parallel import ParallelState, comm, parallel_state_at_entry
from megabert.parallel.param_spec import ParamSpec, spec_table
from megabert.tensor_parallel.layers import unshard

logger = logging.getLogger(__name__)


# How pretrain_bert.py ran, not what the model is: its checkpoints store them True, but a
# loaded model keeps the library's (transformers') outputs unless asked. Unpadding in
# particular must not reach SQuAD, whose span softmax reads the padding positions.
RUN_TIME_CHOICES = ("unpad_input", "mlm_logits_at_masked_only")


def _library_config(saved: dict, overrides: dict) -> ModelConfig:
    defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig) if f.name in RUN_TIME_CHOICES}
    return ModelConfig(**{**saved, **defaults, **overrides})


class PretrainedMixin:
    """Loading and saving for the task models (see megabert.model.bert)."""

    @classmethod
    def from_pretrained(cls, path: Union[str, Source], parallel_state: Optional[ParallelState] = None, *, seed: int = 1234,
                        device=None, params_dtype: torch.dtype = torch.float32,
                        num_layers_per_virtual_stage: Optional[int] = None, first_stage_layers: Optional[int] = None,
                        last_stage_layers: Optional[int] = None, **config_overrides):
        """Loads a Hugging Face BERT directory (config.json + safetensors or pytorch_model.bin),
        a Google TF BERT directory (bert_config.json + bert_model.ckpt.*), or a megabert
        checkpoint of any TP x PP layout; each rank reads and keeps only its own shard. `config_overrides` replace ModelConfig fields (e.g.
        hidden_dropout=0.0). pretrain_bert.py's speed choices saved in a checkpoint
        (RUN_TIME_CHOICES) go back to the library's defaults unless overridden. `path` may be
        a Source a run has detected already (megabert.checkpoint.start). With no
        `parallel_state`: the last init_parallel()'s, or one process's, set up here."""
        ps = parallel_state or parallel_state_at_entry()
        source = as_source(path)
        model = cls(_library_config(read_model_config(source, config_overrides), config_overrides), ps, seed=seed,
                    device=device, params_dtype=params_dtype, num_layers_per_virtual_stage=num_layers_per_virtual_stage,
                    first_stage_layers=first_stage_layers, last_stage_layers=last_stage_layers)
        model.load_local_state_dict(model.read_checkpoint(source, optimizer=False).payload["model"],
                                    source=source.path)
        return model

    def read_checkpoint(self, source: Union[str, Source], optimizer: bool = True) -> RankCheckpoint:
        """This rank's view of any checkpoint (megabert at any layout, Hugging Face, TF), in
        this model's shapes (megabert.checkpoint.reader)."""
        ps = self.parallel_state
        return read_rank(source, tp_rank=ps.tp_rank, tp_size=ps.tp_size, stage=self.stage,
                         padded_vocab_size=self.padded_vocab_size, table=spec_table(self), optimizer=optimizer,
                         model_config=self.config)

    def load_local_state_dict(self, local: dict, source: str = "state dict") -> None:
        """Loads a state dict of this rank's shapes. Missing backbone tensors are an error;
        missing last-stage tensors (a new task head, a pooler) keep their seeded init."""
        table = spec_table(self)
        missing = [k for k in table if k not in local]
        required = [k for k in missing if table[k].placement != "last"]
        if required:
            raise CheckpointError(f"{source} lacks {len(required)} encoder tensors (first: {required[0]}); is it a "
                                  f"BERT of this size?")
        own = self.state_dict()
        for k in table:
            if k in local and tuple(local[k].shape) != tuple(own[k].shape):
                raise CheckpointError(f"{source}: {k} has shape {tuple(local[k].shape)}, the model expects "
                                      f"{tuple(own[k].shape)}; check the model flags against the checkpoint")
        if self.parallel_state.rank == 0:
            if missing:
                logger.warning("%s has no %s: initialised from the seed", source, ", ".join(missing))
            unused = sorted(k for k in local if k not in table)
            if unused:
                logger.info("%s: not used by %s: %s", source, type(self).__name__, ", ".join(unused))
        self.load_state_dict({k: v for k, v in local.items() if k in table}, strict=False)

    def full_state_dict(self) -> dict:
        """This rank's parameters as full (unsharded over TP) CPU tensors, on every TP rank.
        Collective over the TP group. Vocab padding is kept; export removes it."""
        return gather_full(dict(self.named_parameters()), self.parallel_state, spec_table(self))

    def save_hf(self, path: str, vocab_file: Optional[str] = None, *, lower_case: bool = True) -> None:
        """Writes model.safetensors + config.json (+ the tokenizer files with `vocab_file`)
        that transformers loads as they stand (rank 0 writes)."""
        if self.parallel_state.pp_size > 1:
            raise ConfigError("save_hf needs the whole model on each rank (--pipeline-model-parallel-size 1): save a "
                              "checkpoint and run tools/checkpoint/convert_hf.py export on it")
        full = self.full_state_dict()
        arch = hf_io.hf_architecture(self.config, type(self).__name__)
        if self.parallel_state.rank == 0:
            hf_io.write_hf_dir(path, hf_io.megabert_to_hf(full, spec_table(self)),
                               hf_io.hf_config_from_model(self.config, arch), vocab_file, lower_case=lower_case)


@torch.no_grad()
def gather_full(named: dict, ps: ParallelState, table: dict[str, ParamSpec]) -> dict:
    """{name: local shard} -> {name: full CPU tensor}, gathering TP-split tensors as their
    specs say (works for weights and for their gradients alike)."""
    out = {}
    for name, t in named.items():
        t = t.detach()
        spec = table[name]
        if not spec.is_tensor_parallel or ps.tp_size == 1:
            out[name] = t.cpu().clone()
            continue
        parts = [torch.empty_like(t) for _ in range(ps.tp_size)]
        comm.all_gather(parts, t.contiguous(), group=ps.tp_group)
        out[name] = unshard([p.cpu() for p in parts], spec.partition_dim, spec.partition_stride)
    return out
