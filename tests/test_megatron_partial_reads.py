"""Each rank reads only its share of a Megatron-LM checkpoint.

`torch` format: a rank opens only the mp_rank_TT[_PPP] files whose TP slice and pipeline
stage overlap its own (counted at the one place rank files are opened for tensors,
torch_format._load). `torch_dist`: it asks torch.distributed.checkpoint only for its stage's
keys, each stacked layer tensor cut to its layers (counted at dist_format._load). Either way
its tensors equal the whole checkpoint's, split as megabert splits them. read_rank takes the
rank as arguments, so every rank of a layout is checked in this one process.
"""
import os

import torch

import megabert
from megabert.checkpoint.megatron import dist_format, torch_format
from megabert.checkpoint.reader import read_rank
from megabert.checkpoint.sharding import repad_vocab, shard_state
from megabert.parallel.layout import StageLayout
from megabert.parallel.param_spec import spec_table
from tests.helpers.megatron_files import FIXTURES, write_megatron_dir


def _whole(path):
    """The whole model as read at TP 1 x PP 1 (the tests of test_megatron_checkpoints.py give
    megatron-core's logits with it), and its spec table."""
    model = megabert.BertForPreTraining.from_pretrained(path, attention_backend="torch")
    return model.config, spec_table(model), model.state_dict()


def _read_layout(path, tp_size, pp_size, monkeypatch, module):
    """{(tp_rank, pp_rank): what that rank asked `module._load` for}, each rank's weights
    checked against the whole model split for it."""
    cfg, table, whole = _whole(path)
    calls = []
    load = module._load
    monkeypatch.setattr(module, "_load", lambda *a: calls.append(a) or load(*a))
    padded = cfg.padded_vocab_size(tp_size)
    whole_padded = repad_vocab(whole, table, padded)
    asked = {}
    for pp_rank in range(pp_size):
        stage = StageLayout(cfg.num_layers, pp_size, pp_rank)
        for tp_rank in range(tp_size):
            calls.clear()
            got = read_rank(path, tp_rank=tp_rank, tp_size=tp_size, stage=stage, table=table, model_config=cfg,
                            padded_vocab_size=padded, optimizer=False).payload["model"]
            expected = shard_state(whole_padded, table, tp_rank=tp_rank, tp_size=tp_size, stage=stage)
            assert set(got) == set(expected)
            for name, t in got.items():
                assert torch.equal(t, expected[name]), (tp_rank, pp_rank, name)
            asked[(tp_rank, pp_rank)] = list(calls)
    return asked


def _opened(asked):
    return {rank: sorted(os.path.basename(os.path.dirname(path)) for (path,) in calls)
            for rank, calls in asked.items()}


def test_torch_tp2_pp1_read_at_tp2_pp2(monkeypatch):
    """Saved TP 2 x PP 1: rank (t, p) opens mp_rank_0t alone (its TP slice; one stage holds all)."""
    asked = _read_layout(os.path.join(FIXTURES, "tp2_torch"), 2, 2, monkeypatch, torch_format)
    assert _opened(asked) == {(t, p): [f"mp_rank_0{t}"] for t in range(2) for p in range(2)}


def test_torch_tp1_pp2_read_at_tp2_pp2(monkeypatch, tmp_path):
    """Saved TP 1 x PP 2 (legacy names): each stage opens its own stage's file only; the last
    takes the word embeddings from Megatron's copy beside its head (word_embeddings_for_head)."""
    path = write_megatron_dir(str(tmp_path / "m"), 1, era="C", version=3.0, pp=2)
    asked = _read_layout(path, 2, 2, monkeypatch, torch_format)
    assert _opened(asked) == {(t, p): [f"mp_rank_00_00{p}"] for t in range(2) for p in range(2)}


def test_torch_tp2_read_at_tp4_takes_vocab_rows_where_they_are(monkeypatch):
    """TP 4 from TP 2: heads and MLP columns overlap by fraction, but vocab rows are padded per
    TP size (256 saved, 512 here), so rank 1's real rows 128-199 sit in saved rank 1's file;
    ranks 2 and 3 hold padding rows only."""
    asked = _read_layout(os.path.join(FIXTURES, "tp2_torch"), 4, 1, monkeypatch, torch_format)
    assert _opened(asked) == {(0, 0): ["mp_rank_00"], (1, 0): ["mp_rank_00", "mp_rank_01"], (2, 0): ["mp_rank_01"],
                              (3, 0): ["mp_rank_01"]}


def test_torch_dist_asks_for_its_stage_and_layers(monkeypatch):
    """torch_dist saved at TP 2, read at TP 2 x PP 2: stage p asks for layer p of each stacked
    tensor and for its own end's tensors (embeddings first; final LayerNorm, pooler, heads last)."""
    asked = _read_layout(os.path.join(FIXTURES, "tp2_torch_dist"), 2, 2, monkeypatch, dist_format)
    metadata_keys = None
    for (tp_rank, pp_rank), calls in asked.items():
        (iter_dir, metadata, requests), = calls
        metadata_keys = metadata_keys or set(metadata.state_dict_metadata)
        for key, (offsets, sizes) in requests.items():
            if key.startswith("encoder.layers.") and not key.split(".")[2].isdigit():  # stacked [L, ...]
                assert (offsets[0], sizes[0]) == (pp_rank, 1), key
        keys = set(requests)
        assert ("embedding.position_embeddings.weight" in keys) == (pp_rank == 0)
        assert {"pooler.dense.weight", "binary_head.weight", "encoder.final_layernorm.weight"} & keys == \
            (set() if pp_rank == 0 else {"pooler.dense.weight", "binary_head.weight", "encoder.final_layernorm.weight"})
        assert "embedding.word_embeddings.weight" in keys  # both ends hold the tied word embeddings
        assert not any(k.endswith("_extra_state") or "/" in k for k in keys)
