"""Megatron-LM BERT checkpoints read by megabert give megatron-core's own logits.

The fixtures (tests/fixtures/megatron, made by make_megatron_fixtures.py with megatron-core's
BertModel and its own save code) hold megatron-core `torch` and `torch_dist` checkpoints at
TP 1 and 2 and megatron-core's MLM and binary-head logits on fixed inputs. Legacy-format
files (naming eras A/B/C, QKV checkpoint_version 0/1.0/2.0/3.0, PP 2) are built from them
by tests/megatron_files.py (megatron-core's pip package no longer has the legacy model).
Logits are compared at real tokens (megatron-core's b1ss mask also masks padded queries).
"""
import importlib.abc
import os
import sys

import pytest
import torch
from dist_utils import run_distributed
from megatron_files import FIXTURES, reference, write_megatron_dir

import megabert
from megabert.checkpoint.megatron import checkpoint_format, read_header
from megabert.errors import CheckpointError

TOL = 1e-5


def _max_diffs(model, tp_saved: int) -> tuple[float, float]:
    ref = reference(tp_saved)
    with torch.no_grad():
        out = model(ref["input_ids"], token_type_ids=ref["token_type_ids"], attention_mask=ref["attention_mask"])
    real = ref["attention_mask"].bool()
    assert out.mlm_logits.shape == ref["mlm_logits"].shape  # the vocab padding is cut
    return ((out.mlm_logits - ref["mlm_logits"])[real].abs().max().item(),
            (out.nsp_logits - ref["binary_logits"]).abs().max().item())


def _load(path, ps=None, **kw):
    return megabert.BertForPreTraining.from_pretrained(path, ps, attention_backend="torch", **kw).eval()


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
@pytest.mark.parametrize("saved_tp", [1, 2])
def test_megatron_core_checkpoint_gives_its_logits(fmt, saved_tp):
    path = os.path.join(FIXTURES, f"tp{saved_tp}_{fmt}")
    assert checkpoint_format(path) == fmt
    model = _load(path)
    cfg = model.config
    assert (cfg.layernorm_position, cfg.embedding_layernorm, cfg.layernorm_epsilon, cfg.vocab_size) == \
        ("pre", False, 1e-5, 200)
    mlm, nsp = _max_diffs(model, saved_tp)
    assert mlm < TOL and nsp < TOL, (mlm, nsp)


def _read_at_tp2(rank, world):
    ps = megabert.init_parallel(tensor_parallel_size=2)
    for saved_tp in (1, 2):
        for fmt in ("torch", "torch_dist"):
            mlm, nsp = _max_diffs(_load(os.path.join(FIXTURES, f"tp{saved_tp}_{fmt}"), ps), saved_tp)
            assert mlm < TOL and nsp < TOL, (fmt, saved_tp, mlm, nsp)


def test_megatron_core_checkpoints_at_megabert_tp2():
    run_distributed(_read_at_tp2, 2)


@pytest.mark.parametrize("era,version,saved_tp,pp", [
    ("A", 0.0, 2, 1), ("A", 1.0, 2, 2), ("B", 2.0, 1, 2), ("B", 0.0, 1, 1), ("C", 3.0, 2, 1), (None, 3.0, 2, 2)])
def test_legacy_eras_and_qkv_versions(tmp_path, era, version, saved_tp, pp):
    path = write_megatron_dir(str(tmp_path / "m"), saved_tp, era=era, version=version, pp=pp)
    mlm, nsp = _max_diffs(_load(path), saved_tp)
    assert mlm < TOL and nsp < TOL, (mlm, nsp)


def test_qkv_read_in_the_wrong_order_is_caught(tmp_path):
    """Version-0 rows labelled 2.0: read as 2.0, the heads mix and the logits move."""
    path = write_megatron_dir(str(tmp_path / "m"), 2, era="B", version=0.0)
    for rank in ("mp_rank_00", "mp_rank_01"):
        f = tmp_path / "m" / "iter_0000010" / rank / "model_optim_rng.pt"
        payload = torch.load(f, weights_only=False)  # our own file, written above
        payload["checkpoint_version"] = 2.0
        torch.save(payload, f)
    mlm, _ = _max_diffs(_load(path), 2)
    assert mlm > 1e-2


class _BlockMegatron(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "megatron" or name.startswith("megatron."):
            raise ImportError(f"test: importing {name} is blocked")
        return None


def test_loading_never_imports_megatron(tmp_path, monkeypatch):
    for name in [n for n in sys.modules if n == "megatron" or n.startswith("megatron.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [_BlockMegatron()] + sys.meta_path)
    legacy = write_megatron_dir(str(tmp_path / "legacy"), 2, era="A", version=0.0, pp=2)
    for path, saved_tp in ((os.path.join(FIXTURES, "tp2_torch"), 2), (os.path.join(FIXTURES, "tp2_torch_dist"), 2),
                           (legacy, 2)):
        header = read_header(path)
        assert header["iteration"] == 10 and header["args"]["hidden_size"] == 32
        mlm, nsp = _max_diffs(_load(path), saved_tp)
        assert mlm < TOL and nsp < TOL
    # megatron-core's enum in args came back as its value, through a stub, not the class
    assert read_header(os.path.join(FIXTURES, "tp1_torch"))["args"]["attention_backend"] == 4
    assert not [n for n in sys.modules if n == "megatron" or n.startswith("megatron.")]


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_checkpoint_cannot_run_code(tmp_path):
    marker = tmp_path / "ran"
    path = write_megatron_dir(str(tmp_path / "m"), 1)
    f = tmp_path / "m" / "iter_0000010" / "mp_rank_00" / "model_optim_rng.pt"
    payload = torch.load(f, weights_only=False)  # our own file, written above
    payload["args"] = _Evil(str(marker))
    torch.save(payload, f)
    try:
        _load(path)
    except (CheckpointError, Exception):  # refusing the file is as good as ignoring the global
        pass
    assert not marker.exists()


def test_flags_that_disagree_with_the_checkpoint_are_one_line(tmp_path):
    with pytest.raises(CheckpointError) as e:
        _load(os.path.join(FIXTURES, "tp1_torch_dist"), num_layers=3)
    assert "--num-layers 3" in str(e.value) and "num_layers=2" in str(e.value) and "\n" not in str(e.value)


def test_without_args_the_shapes_and_flags_give_the_config(tmp_path):
    path = write_megatron_dir(str(tmp_path / "m"), 2, args=False)
    with pytest.raises(CheckpointError, match="--num-attention-heads"):
        _load(path)
    model = _load(path, num_attention_heads=4, vocab_size=200)
    assert (model.config.num_layers, model.config.hidden_size, model.config.ffn_hidden_size) == (2, 32, 128)
    mlm, nsp = _max_diffs(model, 2)
    assert mlm < TOL and nsp < TOL
