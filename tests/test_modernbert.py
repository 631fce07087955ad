"""ModernBERT equals transformers' ModernBertForMaskedLM loaded from the same directory:
logits, loss and every parameter gradient (fp32), at TP 1 and 2 and PP 2, eager and sdpa
references, padded and unpadded encoders; a wrong TP split of Wi or Wqkv is caught; a local
layer ignores tokens outside its window."""
import pytest
import torch

import megabert
from megabert.checkpoint.hf import megabert_to_hf
from megabert.model.attention import band_mask
from megabert.model.pretrained import gather_full
from megabert.parallel.param_spec import spec_table
from megabert.tensor_parallel.layers import shard
from megabert.training.grads import sync_sequence_parallel_grads, sync_tied_embedding_grads

from tests.helpers.dist_utils import run_distributed
from tests.helpers.hf_models import close
from tests.helpers.modernbert_models import make_modernbert_dir, masked_lm_reference, modernbert_batch

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return make_modernbert_dir(tmp_path_factory.mktemp("modernbert") / "hf")


def _close_logits(logits, ref_logits, am, what="logits"):
    # Padding slots' logits mean nothing: transformers computes them from padding tokens (a
    # local layer's padding query with no real key in its window averages whatever it is
    # given), the unpadded encoder leaves them zero. Compare the real tokens'.
    assert logits.shape == ref_logits.shape, (tuple(logits.shape), tuple(ref_logits.shape))
    close(logits[am.bool()], ref_logits[am.bool()], what)


def _close_grads(model, ps, hf):
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    table = spec_table(model)
    hf_grads = megabert_to_hf(gather_full(grads, ps, table), table)
    ref = {n: p.grad for n, p in hf.named_parameters()}
    assert hf_grads, "no gradients"
    for name, g in hf_grads.items():
        close(g, ref[name], f"grad {name}")
    return hf_grads


def _check_tp(rank, world, hf_dir, impl, backend, unpad, sequence_parallel):
    ps = megabert.init_parallel(tensor_parallel_size=world)
    hf, ref = masked_lm_reference(hf_dir, impl)
    ids, am, labels = modernbert_batch()
    model = megabert.ModernBertForMaskedLM.from_pretrained(hf_dir, ps, attention_backend=backend, unpad_input=unpad,
                                                           sequence_parallel=sequence_parallel)
    out = model(ids, attention_mask=am, labels=labels)
    assert out.logits.shape == (3, ids.size(1), model.config.vocab_size)
    out.loss.backward()
    _close_logits(out.logits, ref.logits, am)
    close(out.loss, ref.loss, "loss")
    sync_sequence_parallel_grads(list(model.parameters()), ps)
    hf_grads = _close_grads(model, ps, hf)
    # Every tensor of transformers' model has its gradient checked (decoder.weight is tied).
    assert set(hf_grads) == {n for n, _ in hf.named_parameters()}


@pytest.mark.parametrize("world,impl,backend,unpad", [
    (1, "eager", "torch", False), (1, "sdpa", "sdpa", False), (1, "eager", "varlen", True),
    (1, "sdpa", "fused", True), (2, "eager", "torch", False), (2, "sdpa", "varlen", True)])
def test_equals_transformers(hf_dir, world, impl, backend, unpad):
    run_distributed(_check_tp, world, hf_dir, impl, backend, unpad, False)


def test_real_vocab_equals_transformers(tmp_path):
    """ModernBERT's vocab, 50,368 (a multiple of 128 but not of 256): padded to 50,432 at TP 2,
    the padding columns never reach the logits, the loss or the gradients."""
    run_distributed(_check_tp, 2, make_modernbert_dir(tmp_path / "hf", vocab_size=50368), "eager", "torch", True,
                    False)


def test_sequence_parallel_equals_transformers(hf_dir):
    run_distributed(_check_tp, 2, hf_dir, "eager", "torch", False, True)


def _check_pp(rank, world, hf_dir, unpad):
    from megabert.pipeline_parallel.p2p import PipeComm
    from megabert.pipeline_parallel.schedules import PipelineSchedule

    ps = megabert.init_parallel(pipeline_model_parallel_size=world)
    hf, ref = masked_lm_reference(hf_dir, "eager")
    ids, am, labels = modernbert_batch()
    model = megabert.ModernBertForMaskedLM.from_pretrained(hf_dir, ps, attention_backend="varlen" if unpad else "torch",
                                                           unpad_input=unpad)
    batch = dict(input_ids=ids, attention_mask=am, labels=labels)
    comm = PipeComm(ps, model.activation_shape(ids.size(1), ids.size(0)), torch.float32)
    from megabert.training.strategy import TrainingTask

    schedule = PipelineSchedule(model, ps, comm, 1, TrainingTask(inputs=(), output_loss=lambda out: (out.loss, {})))
    logits = schedule.forward_only([dict(batch, labels=None)], lambda out: out.logits)
    schedule.forward_backward([batch])
    sync_tied_embedding_grads(list(model.parameters()), ps)
    if ps.is_last_stage:
        _close_logits(logits[0], ref.logits, am)
    _close_grads(model, ps, hf)


@pytest.mark.parametrize("unpad", [False, True])
def test_pipeline_equals_transformers(hf_dir, unpad):
    run_distributed(_check_pp, 2, hf_dir, unpad)


def _wrongly_split(full: torch.Tensor, which: str, rank: int, world: int) -> torch.Tensor:
    """What a naive TP split would give rank `rank`: Wi's rows cut in contiguous halves (rank 0
    all inputs, rank 1 all gates) instead of matching columns of both; Wqkv's rows read as
    [heads, 3, head_dim] instead of transformers' [3, heads, head_dim]."""
    if which == "Wi":
        return shard(full, 0, rank, world, stride=1)
    heads_major = full.view(3, -1, full.size(-1)).transpose(0, 1).reshape_as(full)  # [n, 3, d] order
    return shard(heads_major, 0, rank, world, stride=3)


def _check_wrong_split(rank, world, hf_dir, which):
    ps = megabert.init_parallel(tensor_parallel_size=world)
    _, ref = masked_lm_reference(hf_dir, "eager")
    ids, am, _ = modernbert_batch()
    model = megabert.ModernBertForMaskedLM.from_pretrained(hf_dir, ps, attention_backend="torch")
    table = spec_table(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(f"{'mlp' if which == 'Wi' else 'attn'}.{which}.weight"):
                p.copy_(_wrongly_split(gather_full({name: p}, ps, table)[name], which, rank, world))
    logits = model(ids, attention_mask=am).logits
    diff = (logits - ref.logits)[am.bool()].abs().max().item()
    assert diff > 1e-2, f"a wrong split of {which} went unnoticed (max logit diff {diff})"


@pytest.mark.parametrize("which", ["Wi", "Wqkv"])
def test_wrong_tp_split_is_caught(hf_dir, which):
    """The parity check above would fail for a wrong split: a naive split moves the logits far
    past its tolerance."""
    run_distributed(_check_wrong_split, 2, hf_dir, which)


def test_band_mask_matches_transformers():
    from transformers.masking_utils import sliding_window_bidirectional_overlay

    overlay = sliding_window_bidirectional_overlay(4)
    expected = torch.tensor([[not overlay(0, 0, q, k) for k in range(12)] for q in range(12)])
    assert torch.equal(band_mask(12, 4, "cpu"), expected)


@pytest.mark.parametrize("backend,unpad", [("torch", False), ("sdpa", False), ("fused", False), ("varlen", True)])
def test_local_layer_ignores_tokens_outside_its_window(backend, unpad):
    """Layer 1 is local (window 8: 4 positions each side, inclusive): changing token 15's input
    changes layer 1's output at positions 11 and 19 and not at 10 or 20; a global layer's
    output at 5 does change."""
    cfg = megabert.ModelConfig(model_family="modernbert", num_layers=2, hidden_size=32, num_attention_heads=4,
                               vocab_size=99, max_position_embeddings=64, local_attention=8,
                               global_attn_every_n_layers=2, attention_backend=backend, unpad_input=unpad,
                               init_method_std=0.2)
    model = megabert.ModernBertForMaskedLM(cfg, megabert.init_parallel()).eval()
    backbone = model.bert
    s, b = 24, 2
    am = torch.ones(b, s, dtype=torch.long)
    am[1, 22:] = 0
    x = torch.randn(s, b, 32, generator=torch.Generator().manual_seed(0))
    x2 = x.clone()
    x2[15] += torch.randn(b, 32, generator=torch.Generator().manual_seed(1))  # not a constant: the norm would remove it

    def run(layer, hidden):
        from megabert.model.unpad import TokenLayout

        tokens = TokenLayout(am) if unpad else None
        inputs = backbone._inputs(hidden, am, tokens)
        if tokens is None:
            return layer(hidden, inputs)
        return tokens.pad(layer(tokens.unpad(hidden), inputs))

    with torch.no_grad():
        local, glob = backbone.encoder.layers["1"], backbone.encoder.layers["0"]
        assert not local.attn.is_global and glob.attn.is_global
        y, y2 = run(local, x), run(local, x2)
        g, g2 = run(glob, x), run(glob, x2)
    for p in (10, 20):  # 5 positions away: just outside
        assert torch.equal(y[p], y2[p]), f"position {p} saw a token outside its window"
    for p in (11, 19):  # 4 positions away: the window's inclusive edge
        assert (y[p] - y2[p]).abs().max() > 1e-3, f"position {p} missed a token inside its window"
    assert (g[5] - g2[5]).abs().max() > 1e-3


def test_initialisation_is_truncated_and_scaled():
    cfg = megabert.ModelConfig(model_family="modernbert", num_layers=2, hidden_size=64, num_attention_heads=4,
                               vocab_size=99)
    model = megabert.ModernBertForMaskedLM(cfg, megabert.init_parallel())
    std, cut = cfg.init_method_std, cfg.initializer_cutoff_factor
    out_std = std / (2.0 * cfg.num_layers) ** 0.5
    params = dict(model.named_parameters())
    for name, p in params.items():
        if name.endswith(("Wqkv.weight", "Wi.weight")):
            assert p.abs().max() <= cut * std and abs(p.std().item() - std) < 0.2 * std, name
        elif name.endswith("Wo.weight") or name == "lm_head.dense.weight":
            assert p.abs().max() <= cut * out_std and abs(p.std().item() - out_std) < 0.2 * out_std, name
    emb = params["bert.embeddings.word_embeddings.weight"]
    assert emb[99:].abs().max() == 0 and emb[:99].abs().max() <= cut * std  # vocab padding rows stay zero
    assert all("bias" not in n or n == "lm_head.bias" for n in params)  # no biases but the decoder's


def _train_step(recompute, unpad, dtype=None, p=0.1):
    cfg = megabert.modernbert_tiny(num_layers=3, hidden_size=32, num_attention_heads=4, vocab_size=99,
                                   max_position_embeddings=64, local_attention=8, embedding_dropout=p,
                                   attention_dropout=p, mlp_dropout=p, recompute_granularity=recompute,
                                   unpad_input=unpad, attention_backend="varlen" if unpad else "torch",
                                   mlm_logits_at_masked_only=True)
    model = megabert.ModernBertForMaskedLM(cfg, megabert.init_parallel()).train()
    ids, am, labels = modernbert_batch()
    torch.manual_seed(0)
    with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
        loss = model(ids, attention_mask=am, labels=labels).loss
    loss.backward()
    return loss, {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("unpad", [False, True])
def test_recompute_replays_every_dropout(unpad):
    """Embedding, attention-probability, attention-output and MLP dropout on: full and selective
    recompute give the loss and gradients of no recompute (the per-TP-rank stream restored)."""
    loss, grads = _train_step(None, unpad)
    for recompute in ("full", "selective"):
        other, other_grads = _train_step(recompute, unpad)
        assert torch.equal(loss, other), recompute
        for name, g in grads.items():
            close(other_grads[name], g, f"{recompute} grad {name}")
    assert not torch.equal(_train_step(None, unpad, p=0.0)[0], loss)  # the dropouts did drop


def test_bf16_autocast_is_close_to_fp32():
    loss, _ = _train_step(None, True)
    bf16, grads = _train_step(None, True, torch.bfloat16)
    assert abs(bf16.item() - loss.item()) < 5e-2 and all(torch.isfinite(g).all() for g in grads.values())


def test_bert_task_models_refuse_a_modernbert_config():
    cfg = megabert.modernbert_tiny(num_layers=2, hidden_size=32, vocab_size=99)
    with pytest.raises(megabert.ConfigError, match="ModernBertForMaskedLM"):
        megabert.BertForPreTraining(cfg, megabert.init_parallel())


def test_flops_count_geglu_and_windows():
    from megabert.planning.flops import bert_flops_per_sample

    cfg = megabert.modernbert_tiny(num_layers=3, hidden_size=32, ffn_hidden_size=48, vocab_size=99,
                                   local_attention=8)
    h, f, s = 32, 48, 100
    layer = 2 * (4 * h * h + 3 * h * f)
    expected = 3 * (s * (3 * layer + 4 * h * (s + 9 + 9)) + s * (2 * h * h + 2 * h * 99))
    assert bert_flops_per_sample(cfg, s) == expected


@pytest.mark.parametrize("s,w", [(37, 4), (64, 8), (20, 16)])
def test_blocked_local_attention_equals_the_band_masked_dense_core(s, w):
    """Outputs and gradients of the blocked window equal the dense core under the band mask,
    with padded rows and a length that is no multiple of the block."""
    from megabert.model.local_attention import local_attention
    from megabert.ops.reference import scaled_masked_softmax_reference

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, s, 8, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(3))
    padding = torch.zeros(2, s, dtype=torch.bool)
    padding[1, s - 7:] = True
    out = local_attention(q, k, v, padding, w)
    mask = padding[:, None, None, :] | band_mask(s, w, "cpu")[None, None]
    probs = scaled_masked_softmax_reference(torch.matmul(q, k.transpose(-1, -2)), mask, 8 ** -0.5)
    ref = torch.matmul(probs, v)
    real = ~padding  # padding queries' rows are never read
    close(out.transpose(1, 2)[real], ref.transpose(1, 2)[real], "blocked window")
    grad = torch.randn(ref.shape, generator=gen, dtype=torch.float64) * real[:, None, :, None]
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(ref, (q, k, v), grad)
    for a, b_, name in zip(got, want, "qkv"):
        close(a, b_, f"grad {name}")


def _check_classification(rank, world, hf_dir, unpad):
    ps = megabert.init_parallel(tensor_parallel_size=world)
    hf = transformers.ModernBertForSequenceClassification.from_pretrained(hf_dir, attn_implementation="eager")
    ids, am, _ = modernbert_batch()
    labels = torch.tensor([0, 2, 1])
    ref = hf(input_ids=ids, attention_mask=am, labels=labels)
    ref.loss.backward()
    model = megabert.ModernBertForSequenceClassification.from_pretrained(
        hf_dir, ps, attention_backend="varlen" if unpad else "torch", unpad_input=unpad)
    out = model(ids, attention_mask=am, labels=labels)
    out.loss.backward()
    close(out.logits, ref.logits, "logits")
    close(out.loss, ref.loss, "loss")
    hf_grads = _close_grads(model, ps, hf)
    assert set(hf_grads) == {n for n, _ in hf.named_parameters()}


@pytest.mark.parametrize("pooling,world,unpad", [("cls", 1, True), ("mean", 2, False), ("mean", 1, True)])
def test_sequence_classification_equals_transformers(tmp_path, pooling, world, unpad):
    hf_dir = make_modernbert_dir(tmp_path / "hf", "ModernBertForSequenceClassification", num_labels=3,
                                 classifier_pooling=pooling, classifier_bias=True)
    run_distributed(_check_classification, world, hf_dir, unpad)
