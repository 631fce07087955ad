"""`from_pretrained` (Hugging Face dir or megabert checkpoint) and full-state gathering."""
from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.distributed as dist

from megabert.checkpoint import hf as hf_io
from megabert.checkpoint.layout import load_file, load_full_model, rank_files, resolve_checkpoint_dir
from megabert.checkpoint.sharding import partition_spec, repad_vocab, shard_state
from megabert.config import ModelConfig
from megabert.errors import CheckpointError
from megabert.parallel import ParallelState, get_parallel_state
from megabert.tensor_parallel.layers import unshard

logger = logging.getLogger(__name__)


class PretrainedMixin:
    """Shared by BertForPreTraining and BertForQuestionAnswering."""

    @classmethod
    def from_pretrained(cls, path: str, parallel_state: Optional[ParallelState] = None, *, seed: int = 1234,
                        device=None, params_dtype: torch.dtype = torch.float32, **config_overrides):
        """Loads a Hugging Face BERT directory (config.json + safetensors or pytorch_model.bin)
        or a megabert checkpoint of any TP layout; each rank keeps only its own shard.
        `config_overrides` replace ModelConfig fields (e.g. hidden_dropout=0.0)."""
        ps = parallel_state or get_parallel_state()
        if hf_io.is_hf_dir(path):
            cfg = hf_io.model_config_from_hf(hf_io.read_hf_config(path), **config_overrides)
            model = cls(cfg, ps, seed=seed, device=device, params_dtype=params_dtype)
            full = hf_io.hf_to_megabert(hf_io.read_hf_state(path), cfg, model.bert.padded_vocab_size)
            model.load_full_state_dict(full, source=path)
            return model
        files = rank_files(resolve_checkpoint_dir(path))
        saved_tp = max(t for t, _ in files) + 1
        saved_pp = max(p for _, p in files) + 1
        if saved_tp == ps.tp_size and saved_pp == 1:
            payload = load_file(files[(ps.tp_rank, 0)])  # this rank's shard only
            cfg = ModelConfig(**{**payload["model_config"], **config_overrides})
            model = cls(cfg, ps, seed=seed, device=device, params_dtype=params_dtype)
            model.load_local_state_dict(payload["model"], source=path)
        else:  # another layout: merge and re-split in memory
            full, meta = load_full_model(path)
            cfg = ModelConfig(**{**meta["model_config"], **config_overrides})
            model = cls(cfg, ps, seed=seed, device=device, params_dtype=params_dtype)
            model.load_full_state_dict(full, source=path)
        return model

    def load_full_state_dict(self, full: dict, source: str = "state dict") -> None:
        ps = self.parallel_state
        full = repad_vocab(full, self.config.vocab_size, self.bert.padded_vocab_size)
        local = shard_state(full, tp_rank=ps.tp_rank, tp_size=ps.tp_size, pp_rank=ps.pp_rank, pp_size=ps.pp_size,
                            num_layers=self.config.num_layers,
                            layers_per_virtual_stage=getattr(self, "virtual_stage_layers", None))
        self.load_local_state_dict(local, source=source)

    def load_local_state_dict(self, local: dict, source: str = "state dict") -> None:
        own = self.state_dict()
        missing = [k for k in own if k not in local]
        backbone_missing = [k for k in missing if k.startswith("bert.")]
        if backbone_missing:
            raise CheckpointError(f"{source} lacks {len(backbone_missing)} encoder tensors "
                                  f"(first: {backbone_missing[0]}); is it a BERT of this size?")
        for k in own:
            if k in local and tuple(local[k].shape) != tuple(own[k].shape):
                raise CheckpointError(f"{source}: {k} has shape {tuple(local[k].shape)}, the model expects "
                                      f"{tuple(own[k].shape)}; check the model flags against the checkpoint")
        if missing and ps_rank0(self.parallel_state):
            logger.warning("%s has no %s: initialised from the seed", source, ", ".join(missing))
        unused = [k for k in local if k not in own]
        if unused and ps_rank0(self.parallel_state):
            logger.info("%s: not used by %s: %s", source, type(self).__name__, ", ".join(sorted(unused)))
        self.load_state_dict({k: v for k, v in local.items() if k in own}, strict=False)

    def full_state_dict(self) -> dict:
        """Every parameter and buffer as its full (unsharded) CPU tensor, on every rank.
        Collective over the TP group. Vocab padding is kept; export removes it."""
        return gather_full(self.state_dict(), self.parallel_state)

    def save_hf(self, path: str, vocab_file: Optional[str] = None) -> None:
        """Writes model.safetensors + config.json that transformers loads (rank 0 writes)."""
        full = self.full_state_dict()
        arch = type(self).__name__
        if arch == "BertForPreTraining" and not self.config.bert_binary_head:
            arch = "BertForMaskedLM"  # no pooler / sentence-pair head to export
        if self.parallel_state.rank == 0:
            hf_io.write_hf_dir(path, hf_io.megabert_to_hf(full, self.config),
                               hf_io.hf_config_from_model(self.config, arch), vocab_file)


@torch.no_grad()
def gather_full(named: dict, ps: ParallelState) -> dict:
    """{name: local shard} -> {name: full CPU tensor}, gathering TP-split tensors by the
    sharding rules (works for weights and for their gradients alike)."""
    out = {}
    for name, t in named.items():
        t = t.detach()
        spec = partition_spec(name)
        if spec is None or ps.tp_size == 1:
            out[name] = t.cpu().clone()
            continue
        parts = [torch.empty_like(t) for _ in range(ps.tp_size)]
        dist.all_gather(parts, t.contiguous(), group=ps.tp_group)
        out[name] = unshard([p.cpu() for p in parts], spec[0], spec[1])
    return out


def ps_rank0(ps: ParallelState) -> bool:
    return ps.rank == 0
