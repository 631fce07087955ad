"""Flat MLM positions for unpacked batches (issue 41: "the step must have no host synchronisation").

pretrain_bert.py hands the model the masked positions of each unpacked micro-batch, computed on
the host (`mlm_flat_positions` [n]: row x seq + column of every label != -100, row-major;
megabert.data.packing.flat_label_positions), on every device. The head gathers exactly those n
rows, and the unpadded encoder's last layer maps them (and each row's [CLS]) to its rows of
[T, h] by arithmetic (TokenLayout.head_rows), instead of selecting `labels != -100` with a bool
mask (a nonzero() each: a host sync on a GPU). n follows the data but is the host tensor's
length, so no shape needs a device read. The step equals the bool-mask step (fp32, dropout 0):
loss and every gradient, at TP=1, TP=2, PP=2 and TP=2 with --sequence-parallel. The unpadded
encoder takes its real tokens from the host too (`token_positions` [T]: row x seq + column of
every attention_mask != 0; megabert.data.packing.with_flat_token_positions), so the step's
forward, loss and backward run no data-dependent op at all."""
import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import megabert
from megabert.config import DataConfig
from megabert.data.packing import flat_label_positions, with_flat_label_positions
from megabert.model.pretrained import gather_full
from megabert.parallel.param_spec import spec_table
from megabert.tasks.pretraining import BertForPreTraining
from megabert.tasks.pretraining.task import pretraining_batches

from tests.helpers.dist_utils import patched, run_distributed
from tests.helpers.train_utils import SEQ, VOCAB, batches
from tests.test_model_options import _cfg

MASK_PROB = 0.15
DATA = DataConfig(seq_length=SEQ, mask_prob=MASK_PROB)
CPU = torch.device("cpu")


def _run(model_cfg, data: DataConfig = DATA) -> SimpleNamespace:
    """What pretraining_batches reads of a resolved run."""
    return SimpleNamespace(data=data, model=model_cfg)


def _with_positions(batch: dict, model_cfg, device: torch.device = CPU) -> dict:
    return next(iter(pretraining_batches([batch], _run(model_cfg), device)))


def _batch(micro: int = 4) -> dict:
    b = next(batches(0, micro, 0, 1))
    # a masked [CLS] (in place of row 1's last masked token): read by both heads, computed once
    b["labels"][1, (b["labels"][1] != -100).nonzero().max()] = -100
    b["labels"][1, 0] = b["input_ids"][1, 0]
    return b


def _short(b: dict) -> dict:
    """Row 3 ends at 9 tokens: padding after it, none of it masked."""
    b["attention_mask"][3, 9:] = 0
    b["input_ids"][3, 9:], b["labels"][3, 9:] = 0, -100
    return b


def test_flat_label_positions_are_the_labelled_positions_row_major():
    labels = np.full((3, 5), -100)
    labels[0, [0, 4]] = 7
    labels[2, [1, 2, 3]] = 9  # any number a row: no cap
    assert flat_label_positions(labels).tolist() == [0, 4, 11, 12, 13]
    assert flat_label_positions(labels).dtype == np.int64
    assert flat_label_positions(np.full((2, 4), -100)).tolist() == []
    packed = {"labels": torch.tensor(labels), "packed_seqlens": torch.ones(3, 1)}
    assert "mlm_flat_positions" not in next(with_flat_label_positions([packed], "mlm_flat_positions"))


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_pretraining_batches_add_flat_positions_to_unpacked_batches(device):
    """On every device (the host computes them; no GPU is needed to build CUDA's batches)."""
    b = _batch()
    b["labels"][2, 1:12] = 7  # far more than --mask-prob: listed all the same (no slot to overflow)
    cfg = _cfg(unpad_input=True, mlm_logits_at_masked_only=True)
    out = _with_positions(b, cfg, torch.device(device))
    flat = out["mlm_flat_positions"]
    assert flat.dtype == torch.int64 and "mlm_positions" not in out
    assert flat.tolist() == (b["labels"].reshape(-1) != -100).nonzero().flatten().tolist()
    assert out["token_positions"].tolist() == b["attention_mask"].reshape(-1).nonzero().flatten().tolist()
    # full logits: no masked positions to add, the real tokens' still (the unpadded encoder takes them)
    full = _with_positions(b, _cfg(unpad_input=True))
    assert "mlm_flat_positions" not in full and "token_positions" in full
    # the padded encoder: no real tokens' positions; ModernBERT's head takes the masked ones too
    assert "token_positions" not in _with_positions(b, _cfg(mlm_logits_at_masked_only=True))
    modern = dataclasses.replace(_cfg(mlm_logits_at_masked_only=True), model_family="modernbert")
    assert "mlm_flat_positions" in _with_positions(b, modern)


def _step(model, batch: dict):
    """Forward, the trainer's global-batch loss (sums over the batch's counts) and backward."""
    model.zero_grad()
    out = model(**batch)
    masked, samples = (batch["labels"] != -100).sum(), torch.tensor(batch["labels"].size(0))
    loss = out.mlm_loss_sum / masked + out.nsp_loss_sum / samples
    loss.backward()
    return out, loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _assert_same(a, b):
    (a_out, a_loss, a_grads), (b_out, b_loss, b_grads) = a, b
    torch.testing.assert_close(a_loss, b_loss, atol=1e-6, rtol=0)
    torch.testing.assert_close(a_out.nsp_logits, b_out.nsp_logits, atol=1e-6, rtol=0)
    assert set(a_grads) == set(b_grads)
    for n in a_grads:
        torch.testing.assert_close(a_grads[n], b_grads[n], atol=1e-6, rtol=0, msg=n)


@pytest.mark.parametrize("backend,unpad", [("varlen", True), ("sdpa", True), ("torch", True), ("torch", False)])
def test_flat_step_equals_the_bool_mask_step(backend, unpad):
    """Loss, sentence-pair logits, every gradient (fp32, dropout 0) and the accuracy counts of the
    step with the flat positions equal the bool-mask step's; the MLM logits and labels are the
    bool mask's rows, in its order. A short row, a masked [CLS] and a row masked far above
    --mask-prob (past the slots the previous design gave a sample) are in the batch."""
    from megabert.tasks.pretraining.task import masked_lm_counts

    megabert.init_parallel()
    cfg = _cfg(unpad_input=unpad, mlm_logits_at_masked_only=True)
    cfg.attention_backend = backend
    model = BertForPreTraining(cfg, seed=3)
    plain = _short(_batch())
    plain["labels"][2, 1:10] = plain["input_ids"][2, 1:10]
    given = _with_positions(plain, cfg)
    reference, got = _step(model, plain), _step(model, given)
    _assert_same(got, reference)
    out, masked = got[0], plain["labels"] != -100
    assert out.mlm_logits.shape == (int(masked.sum()), VOCAB)
    torch.testing.assert_close(out.mlm_logits, reference[0].mlm_logits, atol=1e-6, rtol=0)
    assert torch.equal(out.mlm_labels, plain["labels"][masked])
    assert masked_lm_counts(out).tolist() == masked_lm_counts(reference[0]).tolist()


def test_last_layer_computes_cls_and_the_masked_positions():
    """Unpadded: the last layer computes b + n rows ([CLS] of each row, then the n masked
    positions; a masked [CLS] is computed twice and put back once), the bool-mask step the b + n - 1
    distinct ones: no empty slot."""
    megabert.init_parallel()
    cfg = _cfg(unpad_input=True, mlm_logits_at_masked_only=True)
    model = BertForPreTraining(cfg, seed=3)
    rows = []
    last = model.bert.encoder.layers[str(cfg.num_layers - 1)].mlp.dense_h_to_4h
    last.register_forward_hook(lambda m, inputs, out: rows.append(inputs[0].shape[0]))
    plain = _short(_batch())
    model(**_with_positions(plain, cfg))
    model(**plain)
    n = int((plain["labels"] != -100).sum())
    wanted = (plain["labels"] != -100) | (torch.arange(SEQ) == 0)
    assert rows == [4 + n, int(wanted.sum())] and int(wanted.sum()) == 4 + n - 1


def _tp_step(rank, world, backend, out):
    ps = megabert.init_parallel(tensor_parallel_size=world)
    cfg = _cfg(unpad_input=True, mlm_logits_at_masked_only=True)
    cfg.attention_backend = backend
    model = BertForPreTraining(cfg, ps, seed=3)
    plain = _short(_batch())
    results = []
    for batch in (plain, _with_positions(plain, cfg)):
        _, loss, grads = _step(model, batch)
        full = gather_full(grads, ps, spec_table(model))
        results.append((loss, {k: v[:VOCAB] if "word" in k or k == "lm_head.bias" else v for k, v in full.items()}))
    if rank == 0:
        torch.save(results, out)


@pytest.mark.parametrize("backend", ["torch", "varlen"])
def test_flat_step_equals_the_bool_mask_step_at_tp2(tmp_path, backend):
    """TP=2 (the unpadded encoder does not combine with --sequence-parallel: megabert.rules)."""
    run_distributed(_tp_step, 2, backend, str(tmp_path / "r"))
    (ref_loss, ref), (loss, got) = torch.load(tmp_path / "r")
    torch.testing.assert_close(loss, ref_loss, atol=1e-6, rtol=0)
    assert ref and set(ref) == set(got)
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], atol=1e-6, rtol=0, msg=k)


def _trainer_step(rank, world, argv, given, out):
    """One pretrain_bert.py step (the trainer, PP=2's schedule) on the batches it makes (with
    the flat positions: `given`) or on the same batches without them (the bool masks)."""
    import megabert.tasks.pretraining.task as task
    from tests.helpers.train_utils import build_trainer

    seen, original = [], task.pretraining_batches

    def batches_as_handed(b, run, device):  # given: pretraining_batches', else as they come
        for batch in (original(b, run, device) if given else b):
            seen.append("mlm_flat_positions" in batch)
            yield batch

    with patched(task, "pretraining_batches", batches_as_handed):
        _, ps, trainer = build_trainer(argv + ["--mask-prob", str(MASK_PROB), "--train-iters", "1"])
        try:
            trainer.train_step()
            metrics = trainer.flush_metrics()
            model = trainer.strategy.model
            params = {n: p.detach().clone() for n, p in model.named_parameters()}
        finally:
            trainer.close()
    assert seen and set(seen) == {given}
    torch.save({"metrics": metrics, "params": params}, f"{out}.{rank}")


@pytest.mark.parametrize("argv", [["--pipeline-model-parallel-size", "2"], ["--tensor-model-parallel-size", "2"],
                                  ["--tensor-model-parallel-size", "2", "--sequence-parallel"]],
                         ids=["pp2", "tp2", "tp2-sp"])
def test_trainer_step_with_flat_positions_equals_the_bool_mask_step(tmp_path, argv):
    """pretrain_bert.py's step (unpadded encoder, logits at masked positions: its defaults; the
    padded encoder under --sequence-parallel, which the unpadded one does not combine with) with
    the flat positions it adds, against the same step on the batches without them: the logged
    losses, the gradient norm and every parameter after the update, on each rank."""
    run_distributed(_trainer_step, 2, argv, False, str(tmp_path / "a"))
    run_distributed(_trainer_step, 2, argv, True, str(tmp_path / "b"))
    for rank in range(2):
        a, b = torch.load(tmp_path / f"a.{rank}"), torch.load(tmp_path / f"b.{rank}")
        for k in ("lm_loss", "sop_loss", "grad_norm"):
            assert abs(a["metrics"][k] - b["metrics"][k]) <= 1e-6, (k, a["metrics"][k], b["metrics"][k])
        for n in a["params"]:
            torch.testing.assert_close(b["params"][n], a["params"][n], atol=1e-6, rtol=0, msg=n)


def test_unpacked_default_step_has_no_data_dependent_op(monkeypatch):
    """The unpadded encoder's forward, loss (the global batch's counts, tensors) and backward on an
    unpacked micro-batch with the host's positions (masked and real tokens): no data-dependent op;
    the bool-mask step has five (the count of real tokens, TokenLayout's nonzero(); three bool-mask
    indexes in forward, one in backward). Its loss and every gradient are the bool-mask step's."""
    from tests.test_host_syncs import DataDependentOps

    megabert.init_parallel()
    cfg = _cfg(unpad_input=True, mlm_logits_at_masked_only=True)
    cfg.attention_backend = "varlen"
    model = BertForPreTraining(cfg, seed=3)
    plain = _short(_batch())
    given = _with_positions(plain, cfg)
    counts = (plain["labels"] != -100).sum().float(), torch.tensor(4.0)

    def seen(batch):
        ops = DataDependentOps(monkeypatch)
        with ops:
            out = model(**batch)
            (out.mlm_loss_sum / counts[0] + out.nsp_loss_sum / counts[1]).backward()
        monkeypatch.undo()
        return ops.seen

    assert "token_positions" in given and "mlm_flat_positions" in given
    model.zero_grad()
    assert seen(given) == []
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    before = seen(plain)
    assert before.count("aten.nonzero.default") == 1 and len(before) == 5, before
    for n, p in model.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, atol=1e-6, rtol=0, msg=n)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("backend", ["sdpa", "varlen"])
def test_cuda_unpacked_step_waits_for_nothing(backend):
    """On a GPU, counted by torch's sync debug mode (every wait for the device): forward, loss and
    backward of an unpacked micro-batch with the host's positions (masked and real tokens) wait
    nowhere, the bool-mask step five times; loss and every gradient equal (fp32, dropout 0)."""
    import warnings

    megabert.init_parallel()
    cfg = _cfg(unpad_input=True, mlm_logits_at_masked_only=True)
    cfg.attention_backend = backend
    model = BertForPreTraining(cfg, seed=3, device="cuda")
    plain = {k: v.cuda() for k, v in _short(_batch()).items()}
    given = {k: v.cuda() for k, v in _with_positions(_short(_batch()), cfg, torch.device("cuda")).items()}
    counts = (plain["labels"] != -100).sum().float(), torch.tensor(4.0, device="cuda")

    def step(batch):
        model.zero_grad()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                out = model(**batch)
                loss = out.mlm_loss_sum / counts[0] + out.nsp_loss_sum / counts[1]
                loss.backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        waits = [w for w in caught if "synchroniz" in str(w.message)]
        return len(waits), loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    # A first call may wait for one-off set-up (kernel selection, library handles): both paths
    # run once before their waits are counted (the H200 lease counted 25 on a cold sdpa step).
    step(given), step(plain)
    (waits, loss, grads), (ref_waits, ref_loss, ref_grads) = step(given), step(plain)
    assert (waits, ref_waits) == (0, 5)
    torch.testing.assert_close(loss, ref_loss, atol=1e-6, rtol=0)
    for n in grads:
        torch.testing.assert_close(grads[n], ref_grads[n], atol=1e-6, rtol=0, msg=n)


@pytest.mark.parametrize("task", ["glue", "squad"])
def test_finetuning_batches_carry_their_real_tokens(monkeypatch, task):
    """Fine-tuning's unpacked micro-batches get `token_positions` from the host as pre-training's
    do (megabert.training.finetune): the unpadded encoder's step then runs no data-dependent op
    (one nonzero() without them), with the same loss and gradients, through the task's own inputs."""
    from megabert.data.packing import with_flat_token_positions
    from megabert.tasks.glue.finetuning import glue_task
    from megabert.tasks.glue.model import BertForSequenceClassification
    from megabert.tasks.squad.finetuning import qa_task
    from megabert.tasks.squad.model import BertForQuestionAnswering
    from tests.test_host_syncs import DataDependentOps

    megabert.init_parallel()
    cfg = _cfg(unpad_input=True, num_labels=3)
    cfg.attention_backend = "varlen"
    plain = {k: v for k, v in _short(_batch()).items() if k in ("input_ids", "token_type_ids", "attention_mask")}
    if task == "glue":
        model, training_task = BertForSequenceClassification(cfg, seed=3), glue_task()
        plain["labels"] = torch.tensor([0, 2, 1, 1])
    else:
        model, training_task = BertForQuestionAnswering(cfg, seed=3), qa_task()
        plain["start_positions"], plain["end_positions"] = torch.tensor([1, 2, 3, 4]), torch.tensor([2, 5, 3, 8])
    given = next(with_flat_token_positions([plain], "token_positions"))
    assert "token_positions" in training_task.inputs and "token_positions" in given

    def step(batch):
        model.zero_grad()
        ops = DataDependentOps(monkeypatch)
        with ops:
            loss = training_task.output_loss(model(**training_task.model_inputs(batch)))[0]
            loss.backward()
        monkeypatch.undo()
        return ops.seen, loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    (seen, loss, grads), (ref_seen, ref_loss, ref_grads) = step(given), step(plain)
    assert seen == [] and ref_seen == ["aten.nonzero.default"]
    torch.testing.assert_close(loss, ref_loss, atol=1e-6, rtol=0)
    for n in grads:
        torch.testing.assert_close(grads[n], ref_grads[n], atol=1e-6, rtol=0, msg=n)


def test_modernbert_unpacked_step_selects_by_the_hosts_positions(monkeypatch):
    """ModernBERT's unpacked micro-batches get the same host positions (pretraining_batches): its
    unpadded encoder, last layer and MLM head select by index, with no data-dependent op (five
    without: the token count's nonzero(), three bool-mask selections in forward and one in
    backward); the same loss and
    gradients (fp32, dropout 0, the local-window layers included)."""
    from megabert.presets import modernbert_tiny
    from megabert.model import ModernBertForMaskedLM
    from tests.test_host_syncs import DataDependentOps

    megabert.init_parallel()
    cfg = modernbert_tiny(num_layers=3, hidden_size=32, num_attention_heads=4, vocab_size=VOCAB,
                          max_position_embeddings=SEQ, local_attention=8, global_attn_every_n_layers=3,
                          unpad_input=True, mlm_logits_at_masked_only=True, attention_backend="varlen",
                          attention_dropout=0.0, hidden_dropout=0.0, embedding_dropout=0.0)
    model = ModernBertForMaskedLM(cfg, seed=3)
    plain = {k: v for k, v in _short(_batch()).items() if k in ("input_ids", "attention_mask", "labels")}
    run = SimpleNamespace(model=cfg, data=DataConfig(seq_length=SEQ, mask_prob=0.15))
    given = next(iter(pretraining_batches([dict(plain)], run, CPU)))
    assert {"mlm_flat_positions", "token_positions"} <= set(given)

    def step(batch):
        model.zero_grad()
        ops = DataDependentOps(monkeypatch)
        with ops:
            out = model(**batch)
            out.loss.backward()
        monkeypatch.undo()
        return ops.seen, out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    (seen, loss, grads), (ref_seen, ref_loss, ref_grads) = step(given), step(plain)
    assert seen == [] and len(ref_seen) == 5, (seen, ref_seen)
    torch.testing.assert_close(loss, ref_loss, atol=1e-6, rtol=0)
    for n in grads:
        torch.testing.assert_close(grads[n], ref_grads[n], atol=1e-6, rtol=0, msg=n)
