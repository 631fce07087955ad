"""MLM slots for unpacked batches (issue 41: "the step must have no host synchronisation").

On CUDA pretrain_bert.py hands the model each row's masked positions as fixed slots
(`mlm_positions`, computed on the host: megabert.data.packing.label_positions), for unpacked
rows as for packed ones (the CPU keeps the bool masks: unpacked_mlm_slots; the model runs the
same code on either device, so these tests give the CPU's model CUDA's batches). The head reads
those slots, and the unpadded encoder's last layer maps them to its rows of
[T, h] by arithmetic (TokenLayout.head_rows) instead of selecting `labels != -100` with a bool
mask (a nonzero() each: a host sync on a GPU). The step with the slots equals the bool-mask step
(fp32, dropout 0): loss and every gradient, at TP=1, TP=2 and PP=2; and its forward, loss and
backward run one data-dependent op per micro-batch, the unpadded encoder's count of real tokens."""
import dataclasses
from types import SimpleNamespace

import pytest
import torch

import megabert
from megabert.config import DataConfig
from megabert.errors import DataError
from megabert.model.pretrained import gather_full
from megabert.parallel.param_spec import spec_table
from megabert.tasks.pretraining import BertForPreTraining
from megabert.tasks.pretraining.task import mlm_slots_per_row, pretraining_batches

from tests.helpers.dist_utils import patched, run_distributed
from tests.helpers.train_utils import SEQ, VOCAB, batches
from tests.test_model_options import _cfg

# tests.helpers.train_utils.sample masks 3 tokens of 16: the rate whose slots hold them.
MASK_PROB = 0.15
DATA = DataConfig(seq_length=SEQ, mask_prob=MASK_PROB)
SLOTS = mlm_slots_per_row(DATA, packed=False)


def _run(model_cfg, data: DataConfig = DATA) -> SimpleNamespace:
    """What pretraining_batches reads of a resolved run."""
    return SimpleNamespace(data=data, model=model_cfg)


# pretraining_batches adds the slots to unpacked batches bound for CUDA (unpacked_mlm_slots); the
# batches themselves are made on the host, and the model runs the same code on the CPU.
CUDA = torch.device("cuda")


def _with_slots(batch: dict, model_cfg, device: torch.device = CUDA) -> dict:
    return next(iter(pretraining_batches([batch], _run(model_cfg), device)))


def _batch(micro: int = 4) -> dict:
    b = next(batches(0, micro, 0, 1))
    # a masked [CLS] (in place of row 1's last masked token): read by both heads, computed once
    b["labels"][1, (b["labels"][1] != -100).nonzero().max()] = -100
    b["labels"][1, 0] = b["input_ids"][1, 0]
    return b


def test_unpacked_slots_bound_every_sample():
    """floor(mask-prob x seq) + 1 per sample (--max-predictions-per-seq when smaller)."""
    assert mlm_slots_per_row(DataConfig(seq_length=128), packed=False) == 19 + 1
    assert mlm_slots_per_row(DataConfig(seq_length=512), packed=False) == 76 + 1
    assert mlm_slots_per_row(DataConfig(seq_length=128, max_predictions_per_seq=15), packed=False) == 15
    assert SLOTS == 3


def test_pretraining_batches_add_slots_to_unpacked_batches():
    b = _batch()
    out = _with_slots(b, _cfg(unpad_input=True, mlm_logits_at_masked_only=True))
    slots = out["mlm_positions"]
    assert slots.shape == (4, SLOTS) and slots.dtype == torch.int64
    for row in range(4):
        want = (b["labels"][row] != -100).nonzero().flatten().tolist()
        assert slots[row].tolist() == want + [-1] * (SLOTS - len(want))
    # the CPU's default keeps the bool masks (the empty slots cost more there than a wait)
    assert "mlm_positions" not in _with_slots(b, _cfg(unpad_input=True, mlm_logits_at_masked_only=True),
                                              torch.device("cpu"))
    # full logits, or ModernBERT's head: nothing to add
    assert "mlm_positions" not in _with_slots(b, _cfg(unpad_input=True))
    modern = dataclasses.replace(_cfg(mlm_logits_at_masked_only=True), model_family="modernbert")
    assert "mlm_positions" not in _with_slots(b, modern)


def test_a_sample_past_its_slots_is_a_clear_error():
    """Samples masked at a higher rate than --mask-prob (NVIDIA's shards keep their own masks)."""
    b = _batch()
    b["labels"][2, 1:8] = 7
    with pytest.raises(DataError, match=r"a sample holds \d+ masked positions, more than the 3 slots a sample "
                                        r"has: .*--mask-prob"):
        _with_slots(b, _cfg(unpad_input=True, mlm_logits_at_masked_only=True))


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
def test_slots_step_equals_the_bool_mask_step(backend, unpad):
    """Loss, sentence-pair logits, every gradient (fp32, dropout 0) and the accuracy counts of the
    step with the slots equal the bool-mask step's; the MLM logits are [b x slots, V], -100 in
    the empty slots, and equal the bool-mask logits at the masked ones. A short row, a masked
    [CLS] and the empty slots (which read [CLS]) are in the batch."""
    from megabert.tasks.pretraining.task import masked_lm_counts

    megabert.init_parallel()
    cfg = _cfg(unpad_input=unpad, mlm_logits_at_masked_only=True)
    cfg.attention_backend = backend
    model = BertForPreTraining(cfg, seed=3)
    plain = _batch()
    plain["attention_mask"][3, 9:] = 0  # a short row: fewer real tokens than the last layer's slots
    plain["input_ids"][3, 9:], plain["labels"][3, 9:] = 0, -100
    slotted = _with_slots(plain, cfg)
    assert (slotted["mlm_positions"] < 0).any()  # some slots are empty
    reference, got = _step(model, plain), _step(model, slotted)
    _assert_same(got, reference)
    out = got[0]
    masked = plain["labels"] != -100
    assert out.mlm_logits.shape == (4 * SLOTS, VOCAB) and out.mlm_labels.shape == (4 * SLOTS,)
    filled = out.mlm_labels != -100
    torch.testing.assert_close(out.mlm_logits[filled], reference[0].mlm_logits, atol=1e-6, rtol=0)
    assert torch.equal(out.mlm_labels[filled], plain["labels"][masked])
    assert masked_lm_counts(out).tolist() == masked_lm_counts(reference[0]).tolist()


def test_last_layer_computes_cls_and_the_slots():
    """Unpadded: the last layer computes b x (1 + slots) rows (a fixed number: [CLS], then each
    slot; repeats are computed and not put back), the bool-mask step the real ones among them."""
    megabert.init_parallel()
    cfg = _cfg(unpad_input=True, mlm_logits_at_masked_only=True)
    model = BertForPreTraining(cfg, seed=3)
    rows = []
    last = model.bert.encoder.layers[str(cfg.num_layers - 1)].mlp.dense_h_to_4h
    last.register_forward_hook(lambda m, inputs, out: rows.append(inputs[0].shape[0]))
    plain = _batch()
    model(**_with_slots(plain, cfg))
    model(**plain)
    wanted = (plain["labels"] != -100) | (torch.arange(SEQ) == 0)
    assert rows == [4 * (1 + SLOTS), int(wanted.sum())]


def _tp_step(rank, world, backend, out):
    ps = megabert.init_parallel(tensor_parallel_size=world)
    cfg = _cfg(unpad_input=True, mlm_logits_at_masked_only=True)
    cfg.attention_backend = backend
    model = BertForPreTraining(cfg, ps, seed=3)
    plain = _batch()
    results = []
    for batch in (plain, _with_slots(plain, cfg)):
        _, loss, grads = _step(model, batch)
        full = gather_full(grads, ps, spec_table(model))
        results.append((loss, {k: v[:VOCAB] if "word" in k or k == "lm_head.bias" else v for k, v in full.items()}))
    if rank == 0:
        torch.save(results, out)


@pytest.mark.parametrize("backend", ["torch", "varlen"])
def test_slots_step_equals_the_bool_mask_step_at_tp2(tmp_path, backend):
    """TP=2 (the unpadded encoder does not combine with --sequence-parallel: megabert.rules)."""
    run_distributed(_tp_step, 2, backend, str(tmp_path / "r"))
    (ref_loss, ref), (loss, got) = torch.load(tmp_path / "r")
    torch.testing.assert_close(loss, ref_loss, atol=1e-6, rtol=0)
    assert ref and set(ref) == set(got)
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], atol=1e-6, rtol=0, msg=k)


def _trainer_step(rank, world, argv, slots, out):
    """One pretrain_bert.py step (the trainer, PP=2's schedule) on the batches CUDA gets (with
    `slots`) or the CPU gets (without)."""
    import megabert.tasks.pretraining.task as task
    from tests.helpers.train_utils import build_trainer

    seen, original = [], task.pretraining_batches

    def batches_as_handed(b, run, device):  # with slots: pretraining_batches', else as they come
        for batch in (original(b, run, CUDA) if slots else b):  # the model on the CPU, CUDA's batches
            seen.append("mlm_positions" in batch)
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
    assert seen and set(seen) == {slots}
    torch.save({"metrics": metrics, "params": params}, f"{out}.{rank}")


@pytest.mark.parametrize("argv", [["--pipeline-model-parallel-size", "2"], ["--tensor-model-parallel-size", "2"],
                                  ["--tensor-model-parallel-size", "2", "--sequence-parallel"]],
                         ids=["pp2", "tp2", "tp2-sp"])
def test_trainer_step_with_slots_equals_the_bool_mask_step(tmp_path, argv):
    """pretrain_bert.py's step (unpadded encoder, logits at masked positions: its defaults; the
    padded encoder under --sequence-parallel, which the unpadded one does not combine with) with
    the slots it now adds on CUDA, against the same step on the batches without them: the logged
    losses, the gradient norm and every parameter after the update, on each rank."""
    run_distributed(_trainer_step, 2, argv, False, str(tmp_path / "a"))
    run_distributed(_trainer_step, 2, argv, True, str(tmp_path / "b"))
    for rank in range(2):
        a, b = torch.load(tmp_path / f"a.{rank}"), torch.load(tmp_path / f"b.{rank}")
        for k in ("lm_loss", "sop_loss", "grad_norm"):
            assert abs(a["metrics"][k] - b["metrics"][k]) <= 1e-6, (k, a["metrics"][k], b["metrics"][k])
        for n in a["params"]:
            torch.testing.assert_close(b["params"][n], a["params"][n], atol=1e-6, rtol=0, msg=n)


def test_unpacked_default_step_has_one_data_dependent_op(monkeypatch):
    """The unpadded encoder's forward, loss (the global batch's counts, tensors) and backward on an
    unpacked micro-batch with the slots: one data-dependent op, the count of real tokens
    (TokenLayout's nonzero()); the bool-mask step has four more (three bool-mask indexes in
    forward, one in backward)."""
    from tests.test_host_syncs import DataDependentOps

    megabert.init_parallel()
    cfg = _cfg(unpad_input=True, mlm_logits_at_masked_only=True)
    cfg.attention_backend = "varlen"
    model = BertForPreTraining(cfg, seed=3)
    plain = _batch()
    slotted = _with_slots(plain, cfg)
    counts = (plain["labels"] != -100).sum().float(), torch.tensor(4.0)

    def seen(batch):
        ops = DataDependentOps(monkeypatch)
        with ops:
            out = model(**batch)
            (out.mlm_loss_sum / counts[0] + out.nsp_loss_sum / counts[1]).backward()
        monkeypatch.undo()
        return ops.seen

    assert seen(slotted) == ["aten.nonzero.default"]
    before = seen(plain)
    assert before.count("aten.nonzero.default") == 1 and len(before) == 5, before


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("backend", ["sdpa", "varlen"])
def test_cuda_unpacked_step_waits_once_per_micro_batch(backend):
    """On a GPU, counted by torch's sync debug mode (every wait for the device): forward, loss and
    backward of an unpacked micro-batch with the slots wait once (TokenLayout's count of real
    tokens), the bool-mask step five times; loss and every gradient equal (fp32, dropout 0)."""
    import warnings

    megabert.init_parallel()
    cfg = _cfg(unpad_input=True, mlm_logits_at_masked_only=True)
    cfg.attention_backend = backend
    model = BertForPreTraining(cfg, seed=3, device="cuda")
    plain = {k: v.cuda() for k, v in _batch().items()}
    slotted = {k: v.cuda() for k, v in _with_slots(_batch(), cfg).items()}
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

    (waits, loss, grads), (ref_waits, ref_loss, ref_grads) = step(slotted), step(plain)
    assert (waits, ref_waits) == (1, 5)
    torch.testing.assert_close(loss, ref_loss, atol=1e-6, rtol=0)
    for n in grads:
        torch.testing.assert_close(grads[n], ref_grads[n], atol=1e-6, rtol=0, msg=n)
