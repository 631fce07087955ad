"""The layout planner on ModernBERT: parameter counts equal megabert's ModernBERT (built on
the meta device, every pipeline stage, TP 2) and transformers' ModernBertForMaskedLM with
answerdotai/ModernBERT-base's and -large's config values (less megabert's vocab padding);
per-layer activation bytes equal what autograd keeps for backward in megabert's global and
local layers (measured with saved-tensor hooks); the whole model's within a few percent."""
import dataclasses

import pytest
import torch

import megabert
from megabert.config import ModelConfig
from megabert.presets import modernbert_base, modernbert_large, modernbert_tiny
from megabert.planning import Layout, Workload, estimate
from megabert.planning.activations import modernbert_layer_bytes, stage_activation_bytes
from megabert.planning.params import stage_params, total_params

from tests.helpers.dist_utils import run_distributed


def _fake_state(tp, pp, pp_rank):
    from megabert.parallel.state import ParallelState

    return ParallelState(rank=0, world_size=tp * pp, tp_size=tp, pp_size=pp, dp_size=1, tp_rank=0, pp_rank=pp_rank,
                         dp_rank=0, device=torch.device("cpu"), backend="gloo")


def _real_count(cfg, ps) -> int:
    from megabert.model import ModernBertForMaskedLM

    return sum(p.numel() for p in ModernBertForMaskedLM(cfg, ps, device="meta").parameters())


# The answerdotai checkpoints' config.json values (base: transformers' ModernBertConfig defaults).
HF_SHAPES = {"base": dict(hidden_size=768, num_hidden_layers=22, intermediate_size=1152, num_attention_heads=12),
             "large": dict(hidden_size=1024, num_hidden_layers=28, intermediate_size=2624, num_attention_heads=16)}
PRESETS = {"base": modernbert_base, "large": modernbert_large}


def test_base_preset_is_transformers_default_config():
    transformers = pytest.importorskip("transformers")
    hf, ours = transformers.ModernBertConfig(), modernbert_base()
    assert {k: getattr(hf, k) for k in HF_SHAPES["base"]} == HF_SHAPES["base"]
    assert (hf.vocab_size, hf.max_position_embeddings, hf.local_attention) == \
        (ours.vocab_size, ours.max_position_embeddings, ours.local_attention) == (50368, 8192, 128)
    assert (hf.norm_bias, hf.attention_bias, hf.mlp_bias, hf.decoder_bias, hf.classifier_bias) == \
        (ours.norm_bias, ours.attention_bias, ours.mlp_bias, ours.decoder_bias, ours.classifier_bias)
    assert hf.layer_types == ["full_attention" if ours.is_global_layer(i) else "sliding_attention"
                              for i in range(ours.num_layers)]


@pytest.mark.parametrize("size", ["base", "large"])
def test_param_count_equals_megabert_and_transformers(size):
    transformers = pytest.importorskip("transformers")
    cfg = PRESETS[size]()
    shape = HF_SHAPES[size]
    assert (cfg.hidden_size, cfg.num_layers, cfg.ffn_hidden_size, cfg.num_attention_heads) == \
        (shape["hidden_size"], shape["num_hidden_layers"], shape["intermediate_size"], shape["num_attention_heads"])
    assert total_params(cfg) == _real_count(cfg, _fake_state(1, 1, 0))
    with torch.device("meta"):
        hf = transformers.ModernBertForMaskedLM(transformers.ModernBertConfig(**shape))
    hf_count = sum(p.numel() for p in hf.parameters())
    # megabert pads the vocab 50368 -> 50432: 64 more embedding rows and decoder-bias entries.
    padding = cfg.padded_vocab_size(1) - cfg.vocab_size
    assert padding == 64 and total_params(cfg) == hf_count + padding * (cfg.hidden_size + 1)
    assert round(hf_count / 1e6) == {"base": 150, "large": 396}[size]


@pytest.mark.parametrize("cfg", [modernbert_tiny(num_layers=6),
                                 modernbert_tiny(num_layers=4, norm_bias=True, attention_bias=True, mlp_bias=True,
                                                 classifier_bias=True, decoder_bias=False)],
                         ids=["tiny", "tiny-biases"])
def test_pipeline_stage_counts_equal_real_stages(cfg):
    for pp in (2, 3) if cfg.num_layers == 6 else (2,):
        counts = [stage_params(cfg, 1, pp, k).total for k in range(pp)]
        assert counts == [_real_count(cfg, _fake_state(1, pp, k)) for k in range(pp)], pp
        assert sum(counts) == total_params(cfg) + stage_params(cfg, 1, pp, pp - 1).tied_embedding


def _count_worker(rank, world, tp, pp, shapes):
    import datetime

    from megabert.parallel.state import ParallelState

    ps = ParallelState.build(tp, pp, device=torch.device("cpu"), backend="gloo", timeout=datetime.timedelta(minutes=10))
    for shape in shapes:
        cfg = ModelConfig(**shape)
        assert _real_count(cfg, ps) == stage_params(cfg, tp, pp, ps.pp_rank).total, (shape, ps.pp_rank)


def test_tp2_counts_equal_real_per_rank_counts():
    base = modernbert_base(num_layers=3)
    shapes = [{k: getattr(base, k) for k in ("model_family", "num_layers", "hidden_size", "num_attention_heads",
                                             "ffn_hidden_size", "vocab_size", "layernorm_position")}]
    run_distributed(_count_worker, 2, 2, 1, shapes)


def _saved_bytes(model, batch, layer_names=()):
    """Bytes of the distinct storages autograd keeps for backward in one training forward,
    parameters left out: the whole model's, and each named layer's own (storages an earlier
    layer saved, such as the shared RoPE tables, are left out of a layer's)."""
    seen, current = {}, [None]
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen.setdefault(st.data_ptr(), (st.nbytes(), current[0]))
        return t

    for name in layer_names:
        layer = model.bert.encoder.layers[name]
        layer.register_forward_pre_hook(lambda m, a, name=name: current.__setitem__(0, name))
        layer.register_forward_hook(lambda m, a, o: current.__setitem__(0, None))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(**batch).loss.backward()
    per_layer = {name: sum(n for n, owner in seen.values() if owner == name) for name in layer_names}
    return sum(n for n, _ in seen.values()), per_layer


def _model_and_batch(cfg, s, b=1):
    from megabert.model import ModernBertForMaskedLM

    model = ModernBertForMaskedLM(cfg, megabert.init_parallel())
    model.train()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(5, cfg.vocab_size, (b, s), generator=gen)
    labels = torch.full_like(ids, -100)
    picked = torch.rand(b, s, generator=gen) < 0.3
    labels[picked] = ids[picked]
    return model, dict(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels)


# pretrain_bert.py's encoder: unpadded, MLM logits at masked positions only.
SMALL = dict(hidden_size=64, num_attention_heads=2, vocab_size=99, unpad_input=True, mlm_logits_at_masked_only=True)


@pytest.mark.parametrize("recompute", ["none", "selective"])
@pytest.mark.parametrize("kind", ["global", "local"])
def test_layer_activations_equal_saved_tensors(kind, recompute):
    """A middle layer of a ModernBERT (window 128) at s=2048, fp32, not the first of its kind
    (that one saves the kind's RoPE tables, counted per stage): the bytes the planner
    predicts are the bytes autograd keeps."""
    cfg = modernbert_tiny(num_layers=5, global_attn_every_n_layers=3,
                          recompute_granularity=None if recompute == "none" else recompute, **SMALL)
    layer = "3" if kind == "global" else "2"  # global 0 and 3, local 1, 2 and 4
    assert cfg.is_global_layer(int(layer)) == (kind == "global")
    s = 2048
    model, batch = _model_and_batch(cfg, s)
    _, per_layer = _saved_bytes(model, batch, [layer])
    # Measured on the CPU: its gated-activation kernel keeps u alone (3f, not PyTorch's 4f).
    predicted = modernbert_layer_bytes(cfg, Workload(seq_length=s, micro_batch_size=1, device="cpu"), Layout(), recompute,
                                       kind == "global")
    assert per_layer[layer] == pytest.approx(predicted, rel=0.005), (per_layer[layer] / s, predicted / s)


def test_layer_activations_with_pytorchs_gated_chain():
    """--dropout-add-backend torch: PyTorch's GeGLU chain keeps act(input) too (4f a token, as on
    CUDA), and the planner counts it."""
    cfg = modernbert_tiny(num_layers=5, global_attn_every_n_layers=3, dropout_add_backend="torch", **SMALL)
    s = 2048
    model, batch = _model_and_batch(cfg, s)
    _, per_layer = _saved_bytes(model, batch, ["3"])  # a middle global layer, as above
    run = Workload(seq_length=s, micro_batch_size=1, device="cpu")
    predicted = modernbert_layer_bytes(cfg, run, Layout(), "none", True)
    fused = modernbert_layer_bytes(dataclasses.replace(cfg, dropout_add_backend="auto"), run, Layout(), "none", True)
    assert per_layer["3"] == pytest.approx(predicted, rel=0.005), (per_layer["3"] / s, predicted / s)
    assert predicted - fused == s * cfg.ffn_hidden_size * 4  # GELU(input), fp32


def test_model_activations_near_saved_tensors():
    """The whole model's activations, embeddings and MLM head included, at s=2048 x 2."""
    cfg = modernbert_tiny(num_layers=3, **SMALL)
    s, b = 2048, 2
    model, batch = _model_and_batch(cfg, s, b)
    total, _ = _saved_bytes(model, batch)
    run = Workload(seq_length=s, micro_batch_size=b, mask_prob=0.3, device="cpu")
    predicted = stage_activation_bytes(cfg, run, Layout(), 0)
    assert total == pytest.approx(predicted, rel=0.05), (total / s / b, predicted / s / b)


@pytest.mark.parametrize("layout", [Layout(), Layout(tp=2, dp=4), Layout(pp=2, dp=4)], ids=lambda x: x.short())
def test_activations_are_linear_in_the_sequence(layout):
    """No s^2 term: ModernBERT-base's activations at 8192 tokens are 8 x those at 1024 (a
    BERT-style dense core would add 5 a s^2 b per layer, 1.3 GB per layer at 8k in bf16)."""
    cfg = modernbert_base()
    acts = [estimate(cfg, Workload(seq_length=s, micro_batch_size=1, global_batch_size=4, precision="bf16"),
                     layout).activations_gb for s in (1024, 8192)]
    assert acts[1] == pytest.approx(8 * acts[0], rel=1e-3), acts


def test_step_flops_count_the_modules_flops():
    """The planner's step FLOPs of a ModernBERT (global and local layers, the GeGLU, logits at
    every position) equal torch's count of the model's matmuls (forward x 3), at s=32 where
    the window covers the row (the reference core: plain matmuls the counter sees)."""
    from torch.utils.flop_counter import FlopCounterMode

    from megabert.model import ModernBertForMaskedLM
    from megabert.planning.step_time import step_flops

    cfg = modernbert_tiny(num_layers=3, hidden_size=64, num_attention_heads=2, vocab_size=512, local_attention=16,
                          attention_backend="torch")
    s = 32
    model = ModernBertForMaskedLM(cfg, megabert.init_parallel())
    model.eval()
    ids = torch.randint(5, 512, (1, s))
    with FlopCounterMode(display=False) as counter:
        model(ids, attention_mask=torch.ones_like(ids)).logits
    run = Workload(seq_length=s, micro_batch_size=1, mlm_logits_at_masked_only=False)
    # The counter sees the local layers' dense core (s keys); the planner counts the window's.
    dense = 3 * counter.get_total_flops()
    window_saving = 3 * 2 * 4 * s * (s - 17) * cfg.hidden_size  # two local layers
    assert step_flops(cfg, run, Layout()) == pytest.approx(dense - window_saving, rel=0.02)


def test_cli_states_modernbert_memory_at_8k():
    """tools/plan_layout.py --preset modernbert-large at 8192: the README's figures, with
    ModernBERT's 30% of the tokens predicted unless --mask-prob says otherwise."""
    from tests.helpers.cli_utils import run_main

    argv = ["--preset", "modernbert-large", "--seq-length", "8192", "--micro-batch-size", "1", "--global-batch-size",
            "64", "--bf16", "--tensor-model-parallel-size", "2", "--data-parallel-size", "4"]
    r = run_main("tools/plan_layout.py", *argv)
    assert r.returncode == 0, r.stderr
    run = Workload(seq_length=8192, micro_batch_size=1, global_batch_size=64, precision="bf16", mask_prob=0.3)
    est = estimate(modernbert_large(unpad_input=True, mlm_logits_at_masked_only=True), run, Layout(tp=2, dp=4))
    assert "395.9M parameters" in r.stdout
    assert f"(pipeline stage 0): {est.total_gb:.2f} GB" in r.stdout and f"{est.total_gb:.2f}" == "9.98"
    r15 = run_main("tools/plan_layout.py", *argv, "--mask-prob", "0.15")
    assert f"(pipeline stage 0): {est.total_gb:.2f} GB" not in r15.stdout
