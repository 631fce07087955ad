"""Parameters describe themselves: renaming an attribute changes nothing about how the
other tensors are initialised, sharded, resharded or exported, and a parameter nobody
described is caught when the model is built."""
import os

import pytest
import torch
import torch.nn.functional as F

import megabert
from megabert.checkpoint import hf as hf_io
from megabert.checkpoint import reader
from megabert.checkpoint.layout import save_full_model
from megabert.checkpoint.sharding import repad_vocab, shard_state, unshard_states
from megabert.model_classes import reference_table
from megabert.model import transformer
from megabert.parallel import ParallelState
from megabert.parallel.layout import StageLayout
from megabert.parallel.param_spec import spec_table


def _cfg(**kw):
    return megabert.ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=99,
                                max_position_embeddings=32, attention_backend="torch", layernorm_backend="torch", **kw)


class RenamedMLP(transformer.MLP):
    """A user's MLP that calls its first projection `fc_in`."""

    def __init__(self, ctx, hf_prefix):
        super().__init__(ctx, hf_prefix)
        self.fc_in = self.dense_h_to_4h
        del self.dense_h_to_4h

    def forward(self, x):
        return self.dense_4h_to_h(F.gelu(self.fc_in(x)))


@pytest.fixture
def renamed_model(monkeypatch):
    ps = megabert.init_parallel()
    stock = megabert.BertForPreTraining(_cfg(), ps)
    monkeypatch.setattr(transformer, "MLP", RenamedMLP)
    return stock, megabert.BertForPreTraining(_cfg(), ps)


def test_renaming_an_attribute_keeps_init_resharding_and_export(renamed_model, tmp_path):
    stock, renamed = renamed_model
    a, b = dict(stock.named_parameters()), dict(renamed.named_parameters())
    new = {n for n in b if ".mlp.fc_in." in n}
    assert len(new) == 8 and not any(".mlp.fc_in." in n for n in a)
    # Initial weights of every untouched parameter are those of the stock model.
    for name in set(a) & set(b):
        assert torch.equal(a[name], b[name]), name
    # Sharding and resharding follow the specs the parameters carry, whatever their names.
    table = spec_table(renamed)
    full = {n: p.detach().clone() for n, p in b.items()}
    for tp, pp in ((2, 1), (2, 2), (1, 4)):
        grid = [[shard_state(full, table, tp_rank=t, tp_size=tp, stage=StageLayout(4, pp, p)) for t in range(tp)]
                for p in range(pp)]
        back = unshard_states(grid, table)
        assert back.keys() == full.keys() and all(torch.equal(back[k], full[k]) for k in full)
    save_full_model(str(tmp_path / "ck"), full, renamed.config, table, tp_size=2, pp_size=2,
                    model_class="BertForPreTraining")
    merged = reader.read_rank(str(tmp_path / "ck" / "release"), tp_rank=0, tp_size=1, stage=StageLayout(4))
    assert merged.resharded and merged.payload["model"].keys() == full.keys()
    assert all(torch.equal(merged.payload["model"][k], full[k]) for k in full)
    # Export finds the Hugging Face names through the specs, not through our names.
    hf_renamed = hf_io.megabert_to_hf(full, table)
    hf_stock = hf_io.megabert_to_hf({n: p.detach() for n, p in a.items()}, spec_table(stock))
    assert hf_renamed.keys() == hf_stock.keys()
    assert torch.equal(hf_renamed["bert.encoder.layer.2.intermediate.dense.weight"],
                       b["bert.encoder.layers.2.mlp.fc_in.weight"])


def test_a_parameter_nobody_described_is_caught_at_construction():
    class WithExtra(megabert.BertForPreTraining):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.adapter = torch.nn.Linear(32, 32)

    with pytest.raises(megabert.ConfigError, match="adapter.weight has no ParamSpec"):
        WithExtra(_cfg(), megabert.init_parallel())


def test_a_module_that_lost_a_mapped_parameter_is_caught_at_construction(monkeypatch):
    class BrokenMLP(transformer.MLP):
        def __init__(self, ctx, hf_prefix):
            torch.nn.Module.__init__(self)  # builds nothing: the HF table names what is missing
            transformer.set_hf_names(self, {"dense_h_to_4h.weight": hf_prefix + "intermediate.dense.weight"})

    monkeypatch.setattr(transformer, "MLP", BrokenMLP)
    with pytest.raises(megabert.ConfigError, match="BrokenMLP has no parameter 'dense_h_to_4h.weight'"):
        megabert.BertForPreTraining(_cfg(), megabert.init_parallel())


@pytest.mark.parametrize("model_class", ["BertForPreTraining", "BertForQuestionAnswering"])
@pytest.mark.parametrize("pp, per_chunk", [(2, None), (2, 1), (4, None), (4, 1)])
def test_each_stage_builds_exactly_what_the_specs_place_on_it(model_class, pp, per_chunk):
    """What offline sharding puts on a stage (from the table) is what the model builds there."""
    cfg = _cfg()
    cls = getattr(megabert, model_class)  # imports the class, which registers its reference table
    table = reference_table(cfg, model_class)
    for rank in range(pp):
        stage_model = cls(cfg, ParallelState.offline(pp_size=pp, pp_rank=rank), device="meta",
                          num_layers_per_virtual_stage=per_chunk)
        expected = {n for n, s in table.items() if StageLayout(4, pp, rank, per_chunk).holds(s)}
        assert set(dict(stage_model.named_parameters())) == expected, rank


def test_checkpoints_written_before_spec_tables_still_load(tmp_path):
    """A checkpoint without `param_specs` (written before them) is read with the table
    of a shape-only model of its class."""
    ps = megabert.init_parallel()
    model = megabert.BertForPreTraining(_cfg(), ps)
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    root = str(tmp_path / "old")
    save_full_model(root, full, model.config, spec_table(model), tp_size=2, pp_size=2, model_class="BertForPreTraining")
    for d in os.listdir(os.path.join(root, "release")):
        f = os.path.join(root, "release", d, "model_optim_rng.pt")
        payload = torch.load(f, weights_only=True)
        del payload["param_specs"]
        torch.save(payload, f)
    loaded, _, table = reader.read_full(root)
    rows = {k: table[k].valid_rows for k in full}  # vocab tensors come back padded for TP=2
    assert all(torch.equal(loaded[k][:rows[k]], full[k][:rows[k]]) for k in full)
    again = megabert.BertForPreTraining.from_pretrained(root, ps)
    assert all(torch.equal(p, full[n]) for n, p in again.named_parameters())


@pytest.mark.parametrize("tp, pp, rank", [(1, 2, (0, 1)), (2, 4, (1, 0)), (4, 1, (3, 0))])
def test_a_rank_reshards_only_the_tensors_it_holds(tmp_path, monkeypatch, tp, pp, rank):
    """Reading a tp2 x pp2 checkpoint at another layout merges only this rank's tensors,
    and gives exactly the slice offline sharding of the full model gives."""
    ps = megabert.init_parallel()
    model = megabert.BertForPreTraining(_cfg(), ps)
    full, table = {n: p.detach().clone() for n, p in model.named_parameters()}, spec_table(model)
    save_full_model(str(tmp_path / "ck"), full, model.config, table, tp_size=2, pp_size=2,
                    model_class="BertForPreTraining")
    merged = []
    real = reader.unshard_states
    monkeypatch.setattr(reader, "unshard_states", lambda *a, **kw: merged.append(real(*a, **kw)) or merged[-1])
    t, p = rank
    stage = StageLayout(4, pp, p)
    ckpt = reader.read_rank(str(tmp_path / "ck"), tp_rank=t, tp_size=tp, stage=stage)
    held = {n for n, s in table.items() if stage.holds(s)}
    assert ckpt.resharded and (ckpt.saved_tp, ckpt.saved_pp) == (2, 2)
    assert len(merged) == 1 and set(merged[0]) == held and (pp == 1 or len(held) < len(full))
    padded = repad_vocab(full, table, model.config.padded_vocab_size(tp))
    expected = shard_state(padded, table, tp_rank=t, tp_size=tp, stage=stage)
    assert ckpt.payload["model"].keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(ckpt.payload["model"][name], tensor), name
    assert ckpt.payload["parallel"]["tensor_model_parallel_size"] == tp and ckpt.payload["rng"] is None
