"""Model options: pre-LN is layout-independent; masked-only MLM logits give the same loss
and the same logits at the masked positions as computing all of them."""
import torch

import megabert
from megabert.config import ModelConfig
from megabert.model.pretrained import gather_full
from megabert.parallel.param_spec import spec_table

from tests.helpers.dist_utils import run_distributed
from tests.helpers.kernel_checks import graph_functions
from tests.helpers.train_utils import batches


def _cfg(**kw):
    return ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=99, max_position_embeddings=32,
                       hidden_dropout=0, attention_dropout=0, attention_backend="torch", layernorm_backend="torch",
                       **kw)


def _pre_ln(rank, world, out):
    ps = megabert.init_parallel(tensor_parallel_size=world)
    model = megabert.BertForPreTraining(_cfg(layernorm_position="pre"), ps)
    assert model.bert.encoder.final_layernorm is not None
    b = next(batches(0, 4, 0, 1))
    o = model(b["input_ids"], b["token_type_ids"], b["attention_mask"], b["labels"], b["next_sentence_label"])
    o.loss.backward()
    grads = gather_full({n: p.grad for n, p in model.named_parameters()}, ps, spec_table(model))
    logits = o.mlm_logits.detach()  # gathered over TP: every rank takes part
    if rank == 0:
        torch.save({"loss": o.loss.detach(), "logits": logits,
                    "grads": {k: v[:99] if "word" in k or k == "lm_head.bias" else v for k, v in grads.items()}}, out)


def test_pre_layernorm_tp2_equals_tp1(tmp_path):
    run_distributed(_pre_ln, 1, str(tmp_path / "a"))
    run_distributed(_pre_ln, 2, str(tmp_path / "b"))
    a, b = torch.load(tmp_path / "a"), torch.load(tmp_path / "b")
    assert torch.allclose(a["loss"], b["loss"], atol=1e-6)
    assert torch.allclose(a["logits"], b["logits"], atol=1e-5)
    assert a["grads"] and set(a["grads"]) == set(b["grads"])
    for k in a["grads"]:
        assert torch.allclose(a["grads"][k], b["grads"][k], atol=1e-5), k


def _masked_only(rank, world):
    ps = megabert.init_parallel(tensor_parallel_size=world)
    full = megabert.BertForPreTraining(_cfg(), ps)
    sparse = megabert.BertForPreTraining(_cfg(mlm_logits_at_masked_only=True), ps)
    b = next(batches(0, 4, 0, 1))
    args = (b["input_ids"], b["token_type_ids"], b["attention_mask"], b["labels"], b["next_sentence_label"])
    o_full, o_sparse = full(*args), sparse(*args)
    selected = b["labels"] != -100
    assert o_sparse.mlm_logits.shape == (int(selected.sum()), 99)
    assert torch.allclose(o_sparse.mlm_logits, o_full.mlm_logits[selected], atol=1e-5)
    assert torch.allclose(o_sparse.loss, o_full.loss, atol=1e-6)
    # Without labels there is nothing to select: full logits, as transformers returns.
    unlabelled = sparse(*args[:3]).mlm_logits
    assert torch.allclose(unlabelled, full(*args[:3]).mlm_logits, atol=1e-5) and unlabelled.shape[:2] == (4, 16)
    o_full.loss.backward()
    o_sparse.loss.backward()
    for (n, p), (_, q) in zip(full.named_parameters(), sparse.named_parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-6), n


def test_masked_only_logits_match_full():
    run_distributed(_masked_only, 2)


def _assert_same_step(reference, other):
    """(loss, sentence-pair logits, {name: grad}) of two models' step: loss and logits to
    1e-6, every gradient (none missing) to rtol 1e-5 / atol 1e-6."""
    (loss0, nsp0, g0), (loss1, nsp1, g1) = reference, other
    torch.testing.assert_close(loss1, loss0, rtol=0, atol=1e-6)
    torch.testing.assert_close(nsp1, nsp0, rtol=0, atol=1e-6)
    assert g0 and set(g1) == set(g0) and all(g is not None for g in (*g0.values(), *g1.values()))
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-5, atol=1e-6, msg=name)


def _unpadded_vs_padded(layernorm_position, recompute, backend):
    ps = megabert.init_parallel()
    b = next(batches(0, 4, 0, 1))
    assert (b["attention_mask"] == 0).any()  # the tiny samples are padded
    results = []
    for unpad in (False, True):
        cfg = _cfg(unpad_input=unpad, layernorm_position=layernorm_position, recompute_granularity=recompute)
        cfg.attention_backend = backend
        model = megabert.BertForPreTraining(cfg, ps, seed=5).train()
        o = model(b["input_ids"], b["token_type_ids"], b["attention_mask"], b["labels"], b["next_sentence_label"])
        o.loss.backward()
        results.append((o.loss.detach(), o.nsp_logits.detach(), {n: p.grad for n, p in model.named_parameters()}))
    _assert_same_step(*results)


def test_unpadded_encoder_equals_padded():
    """Leaving padding out of the token-wise work changes nothing the loss sees: loss,
    sentence-pair logits and every gradient equal the padded model's (post- and pre-LN,
    activation recompute, each attention backend)."""
    for args in [("post", None, "torch"), ("pre", "full", "sdpa"), ("post", "selective", "fused")]:
        _unpadded_vs_padded(*args)


def _head_rows_vs_all_rows(layernorm_position, recompute, backend):
    ps = megabert.init_parallel()
    b = next(batches(0, 4, 0, 1))
    args = (b["input_ids"], b["token_type_ids"], b["attention_mask"], b["labels"], b["next_sentence_label"])
    results, last_mlp_rows = [], []
    for masked_only in (False, True):
        cfg = _cfg(unpad_input=True, mlm_logits_at_masked_only=masked_only, layernorm_position=layernorm_position,
                   recompute_granularity=recompute)
        cfg.attention_backend = backend
        model = megabert.BertForPreTraining(cfg, ps, seed=5).train()
        last = model.bert.encoder.layers[str(cfg.num_layers - 1)].mlp.dense_h_to_4h
        last.register_forward_hook(lambda m, inputs, out: last_mlp_rows.append(inputs[0].shape[0]))
        o = model(*args)
        o.loss.backward()
        selected = b["labels"] != -100
        logits = o.mlm_logits if masked_only else o.mlm_logits[selected]
        results.append((o.loss.detach(), o.nsp_logits.detach(), logits.detach(),
                        {n: p.grad for n, p in model.named_parameters()}))
    # All real tokens, then [CLS] and the masked positions alone (the first forward of each).
    head_positions = (b["labels"] != -100) | (torch.arange(b["labels"].size(1)) == 0)
    assert last_mlp_rows[0] == int(b["attention_mask"].sum())
    assert last_mlp_rows[-1] == int((head_positions & (b["attention_mask"] != 0)).sum()) < last_mlp_rows[0]
    (loss0, nsp0, logits0, g0), (loss1, nsp1, logits1, g1) = results
    torch.testing.assert_close(logits1, logits0, rtol=0, atol=1e-5)
    _assert_same_step((loss0, nsp0, g0), (loss1, nsp1, g1))


def test_last_layer_runs_on_the_head_positions_alone():
    """Unpadded, with logits at masked positions only: the last layer's output is computed at
    [CLS] and the masked positions alone (attention still reads every token), and loss,
    sentence-pair logits, MLM logits and every gradient equal computing it everywhere."""
    import megabert.fused_kernels as fk

    cases = [("post", None, "torch"), ("pre", "full", "sdpa"), ("post", "selective", "fused")]
    if fk.is_available():
        cases += [("post", None, "varlen"), ("pre", "selective", "varlen")]
    for args in cases:
        _head_rows_vs_all_rows(*args)


def test_unpadding_and_sequence_parallel_do_not_combine():
    import pytest

    from megabert.arguments import parse_args

    # pretrain_bert.py unpads by default, and leaves it off under --sequence-parallel ...
    assert parse_args(["--data-path", "x"]).model.unpad_input
    assert not parse_args(["--data-path", "x", "--sequence-parallel"]).model.unpad_input
    # ... where asking for both is one line naming the flags.
    with pytest.raises(megabert.ConfigError, match="--unpad-input cannot combine with --sequence-parallel"):
        parse_args(["--data-path", "x", "--sequence-parallel", "--unpad-input"])
    from megabert.rules import check_model  # the Python API: the model's own check when it is built

    with pytest.raises(megabert.ConfigError, match="--unpad-input cannot combine with --sequence-parallel"):
        check_model(_cfg(unpad_input=True, sequence_parallel=True))


def _dropout_add_layers(rank, world, backend, sequence_parallel):
    ps = megabert.init_parallel(tensor_parallel_size=world)
    cfg = _cfg(layernorm_position="pre", sequence_parallel=sequence_parallel, dropout_add_backend=backend)
    cfg.hidden_dropout = 0.5
    model = megabert.BertForPreTraining(cfg, ps, seed=5).train()
    assert model.ctx.dropout_add_backend == ("fused" if backend == "auto" else backend)
    layer = model.bert.encoder.layers["0"]
    x = torch.randn(16, 4, 32, generator=torch.Generator().manual_seed(1))
    if sequence_parallel:  # this rank's slice of the sequence
        x = x.chunk(world)[ps.tp_rank].contiguous()
    x.requires_grad_()
    torch.manual_seed(11)
    tp_stream = model.ctx.rng.get_states()
    y = layer(x, None)
    fused = any(n.startswith("FusedDropoutAdd") for n in graph_functions(y))
    assert fused == (model.ctx.dropout_add_backend == "fused")
    # The same generator states replay the same masks; the next call draws new ones.
    torch.manual_seed(11)
    model.ctx.rng.set_states(tp_stream)
    assert torch.equal(layer(x, None), y)
    assert not torch.equal(layer(x, None), y)
    y.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    if sequence_parallel:
        # Slices draw from the per-TP-rank stream: the two ranks' masks differ though
        # their default streams (and inputs, here) agree.
        torch.manual_seed(11)
        same_input = torch.ones(8, 4, 32)
        with torch.no_grad():
            d = layer._epilogue(same_input, torch.zeros_like(same_input))
        gathered = [torch.empty_like(d) for _ in range(world)]
        torch.distributed.all_gather(gathered, d, group=ps.tp_group)
        assert not torch.equal(gathered[0], gathered[1])


def test_layers_use_the_fused_dropout_add_on_cpu():
    """--dropout-add-backend auto is the fused kernel on the CPU (torch is PyTorch's dropout);
    it replays from the torch seed, and under sequence parallelism it draws from the
    per-TP-rank stream as F.dropout did."""
    for backend in ("auto", "torch"):
        _dropout_add_layers(0, 1, backend, False)
    run_distributed(_dropout_add_layers, 2, "auto", True)


def _qa_from_unpadded_pretraining(rank, world, root):
    from megabert.config import FinetuneConfigs, OptimConfig, ParallelConfig, TrainConfig
    from megabert.tasks.squad.config import SquadConfig
    from megabert.tasks.squad.finetuning import load_qa_model
    from megabert.checkpoint.manager import CheckpointManager
    from megabert.checkpoint.run_state import TrainingState
    from megabert.checkpoint.start import require_source
    from megabert.training.checkpoint_state import model_parts

    ps = megabert.init_parallel()
    model = megabert.BertForPreTraining(_cfg(unpad_input=True), ps)
    CheckpointManager(model_parts(model, ps), ps).save(root, TrainingState(), extra={}, keep_last=None)  # no optimizer
    cfg = FinetuneConfigs(parallel=ParallelConfig(), optim=OptimConfig(), train=TrainConfig(load=root),
                          finetune=SquadConfig(train_file="t.json", max_seq_length=32,
                                                                   max_query_length=8, doc_stride=8))
    assert not load_qa_model(cfg, require_source(root), ps, 99).config.unpad_input


def test_squad_fine_tuning_keeps_the_padded_encoder(tmp_path):
    """pretrain_bert.py's checkpoints say unpad_input=True; SQuAD's span softmax reads the
    padding positions, so fine-tuning builds the padded encoder from them."""
    run_distributed(_qa_from_unpadded_pretraining, 1, str(tmp_path / "ckpt"))
