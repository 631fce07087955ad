"""The fixed-shape packed step (issue 41, part 2; megabert.model.packed): every tensor of a packed
micro-batch, and everything the model derives from it, has a shape the flags fix; its loss and
every gradient equal the same samples unpacked (fp32, dropout 0); on a GPU it is captured as a
CUDA graph and replayed on other rows, and it reads nothing back from the device.

The no-host-value property on the CPU: tests/test_host_syncs.py (the ops) and
tests/test_compile.py (one fullgraph compilation for different packings)."""
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import megabert
from megabert.config import DataConfig, ModelConfig
from megabert.data.packing import PACKED_COUNTS, PackingSpec, label_positions, pack_window, packed_micro_batches
from megabert.errors import DataError
from megabert.tasks.pretraining import BertForPreTraining
from megabert.tasks.pretraining.task import mlm_slots_per_row, pretraining_batches

from tests.test_packing import CAP, N, SAMPLES, SEQ, SPEC, VOCAB, sample

# sample() masks 2 tokens of 3-14: the rate that bounds 3 of them a row (see test_packing.TINY).
MASK_PROB = 0.25
SLOTS = mlm_slots_per_row(DataConfig(seq_length=SEQ, mask_prob=MASK_PROB, max_samples_per_row=CAP))

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def test_mlm_slots_bound_every_row_megabert_masks():
    """floor(mask-prob x seq) + max-samples-per-row (NVIDIA's max_predictions_per_seq for a row)
    holds the masked positions of any row of samples that megabert's masking made."""
    from megabert.tasks.pretraining.masking import mask_tokens

    data = DataConfig(seq_length=128, max_samples_per_row=3)
    slots = mlm_slots_per_row(data)
    assert slots == 19 + 3
    assert mlm_slots_per_row(DataConfig(seq_length=128, max_samples_per_row=3, max_predictions_per_seq=5)) == 15
    rng = np.random.default_rng(0)
    worst = 0
    for _ in range(2000):  # rows of 1-3 samples of any lengths that fit
        k = int(rng.integers(1, 4))
        lengths = rng.multinomial(128 - 3 * k, np.ones(k) / k) + 3  # each [CLS] x [SEP] + maskable tokens
        masked = 0
        for n in lengths:
            maskable = np.zeros(n, dtype=bool)
            maskable[1:-1] = True
            _, labels = mask_tokens(np.arange(n) + 5, maskable, rng, mask_prob=data.mask_prob,
                                    max_predictions=19, mask_id=4, random_ids=np.arange(5, 50))
            masked += int((labels != -100).sum())
        worst = max(worst, masked)
    assert 19 <= worst <= slots


def test_label_positions_are_fixed_slots():
    labels = np.full((2, 8), -100)
    labels[0, [1, 4, 6]] = 7
    positions = label_positions(labels, 4)
    assert positions.tolist() == [[1, 4, 6, -1], [-1, -1, -1, -1]]
    assert label_positions(labels, 2) is None


def test_a_row_past_its_slots_is_a_clear_error():
    window = pack_window(SAMPLES, 0, SPEC)
    batch = {k: torch.from_numpy(v) for k, v in window.items() if k != "row_samples"}
    from megabert.data.packing import with_label_positions

    with pytest.raises(DataError, match="more than the 3 slots a row has: pass X"):
        next(with_label_positions([batch], 3, "mlm_positions", "pass X"))


def _config(backend: str, unpad_input: bool = False) -> ModelConfig:
    """--no-unpad-input: the fixed-shape path on the CPU too (megabert.model.packed.fixed_shape_packing)."""
    return ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=VOCAB,
                       max_position_embeddings=32, hidden_dropout=0.0, attention_dropout=0.0,
                       attention_backend=backend, unpad_input=unpad_input, mlm_logits_at_masked_only=True)


def _packed_batches(samples, micro_batch: int, device="cpu", unpad_input: bool = False) -> list[dict]:
    """Packed micro-batches of `samples` as pretrain_bert.py hands them to the model."""
    spec = PackingSpec(seq_length=SEQ, max_samples_per_row=CAP, window=len(samples), seed=5,
                       sample_fields=("next_sentence_label",))
    # What pretraining_batches reads of a resolved run.
    run = SimpleNamespace(data=DataConfig(seq_length=SEQ, mask_prob=MASK_PROB, max_samples_per_row=CAP,
                                          pack_sequences=True),
                          model=_config("varlen", unpad_input=unpad_input))
    out = []
    for b in pretraining_batches(packed_micro_batches([pack_window(samples, 0, spec)], spec, 0, micro_batch, 0, 1),
                                 run, torch.device(device)):
        b.pop(PACKED_COUNTS)
        out.append({k: v.to(device) for k, v in b.items()})
    return out


def _global_loss(out, batch_masked, batch_samples):
    """The trainer's global-batch normalisation: the sums over the global batch's counts, tensors."""
    return out.mlm_loss_sum / batch_masked + out.nsp_loss_sum / batch_samples


@pytest.mark.parametrize("backend,unpad", [("varlen", False), ("sdpa", False), ("torch", False), ("varlen", True)])
def test_fixed_shape_packed_step_equals_the_samples_unpacked(backend, unpad):
    """The packed rows of N samples with mlm_positions: the global-batch loss and every gradient equal
    those of the N samples padded (fp32, dropout 0) to 1e-6; the MLM logits are [rows x slots, V].
    (unpad: the CPU's unpadded encoder given mlm_positions by hand: the heads' slots still hold.)"""
    megabert.init_parallel()
    model = BertForPreTraining(_config(backend, unpad_input=unpad), seed=3)
    (packed,) = _packed_batches(SAMPLES, micro_batch=len(pack_window(SAMPLES, 0, SPEC)["row_samples"]))
    assert packed["mlm_positions"].shape == (packed["input_ids"].size(0), SLOTS)
    unpacked = {k: torch.from_numpy(np.stack([s[k] for s in SAMPLES])) for k in SAMPLES[0]}
    masked = (unpacked["labels"] != -100).sum()
    samples = torch.tensor(N)

    def run(batch):
        model.zero_grad()
        out = model(**batch)
        loss = _global_loss(out, masked, samples)
        loss.backward()
        return out, loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    (p_out, p_loss, p_grads), (u_out, u_loss, u_grads) = run(packed), run(unpacked)
    torch.testing.assert_close(p_loss, u_loss, atol=1e-6, rtol=0)
    for n in u_grads:
        torch.testing.assert_close(p_grads[n], u_grads[n], atol=1e-6, rtol=0, msg=n)
    rows = packed["input_ids"].size(0)
    assert p_out.mlm_logits.shape == (rows * SLOTS, VOCAB) and p_out.mlm_labels.shape == (rows * SLOTS,)
    assert int((p_out.mlm_labels != -100).sum()) == int(masked)
    # the accuracy counts see the same masked tokens
    from megabert.tasks.pretraining.task import masked_lm_counts

    assert masked_lm_counts(p_out).tolist() == masked_lm_counts(u_out).tolist()


def test_fixed_shape_packing_is_the_default_on_cuda_only():
    """pretraining_batches adds mlm_positions where the model takes the fixed-shape path: CUDA, or the
    CPU with --no-unpad-input; the CPU's default (unpadded) packed batches stay as they were."""
    from megabert.model.packed import fixed_shape_packing

    assert fixed_shape_packing(torch.device("cuda"), True) and fixed_shape_packing(torch.device("cpu"), False)
    assert not fixed_shape_packing(torch.device("cpu"), True)
    assert "mlm_positions" in _packed_batches(SAMPLES, micro_batch=2)[0]
    assert "mlm_positions" not in _packed_batches(SAMPLES, micro_batch=2, unpad_input=True)[0]


# ------------------------------------------------------------------ on a GPU


def _three_packings(device) -> list[dict]:
    """Three micro-batches of 2 rows whose rows hold different numbers of samples."""
    batches = _packed_batches([sample(i) for i in range(64)], 2, device)
    chosen, seen = [], set()
    for b in batches:
        key = tuple((b["packed_seqlens"] > 0).sum(1).tolist())
        if key not in seen:
            seen.add(key)
            chosen.append(b)
    assert len(chosen) >= 3
    return chosen[:3]


def _counts(batch) -> tuple[torch.Tensor, torch.Tensor]:
    return (batch["labels"] != -100).sum().float(), (batch["next_sentence_label"] != -100).sum().float()


@needs_cuda
def test_cuda_graph_of_the_packed_step_replays_new_rows_as_eager():
    """Forward, loss (denominators as tensors) and backward of a packed micro-batch captured once
    with torch.cuda.graph; replayed on rows that hold other samples (other numbers of them), it
    gives eager mode's loss and gradients."""
    device = torch.device("cuda")
    megabert.init_parallel()
    model = BertForPreTraining(_config("varlen"), seed=3, device=device)
    reference = BertForPreTraining(_config("varlen"), seed=3, device=device)  # the same weights (one seed)
    batches = _three_packings(device)
    static = {k: v.clone() for k, v in batches[0].items()}
    static_counts = [c.clone() for c in _counts(batches[0])]

    def step(m, batch, counts):
        loss = _global_loss(m(**batch), *counts)
        loss.backward()
        return loss

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture (as torch.cuda.graphs asks)
        for _ in range(3):
            model.zero_grad(set_to_none=True)
            step(model, static, static_counts)
    torch.cuda.current_stream().wait_stream(side)
    model.zero_grad(set_to_none=True)  # the graph's backward allocates .grad from its own pool
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = step(model, static, static_counts)
    for batch in batches[1:] + batches[:1]:
        for k in static:
            static[k].copy_(batch[k])
        for c, v in zip(static_counts, _counts(batch)):
            c.copy_(v)
        graph.replay()
        reference.zero_grad(set_to_none=True)
        want = step(reference, batch, _counts(batch))
        torch.testing.assert_close(static_loss, want, atol=1e-5, rtol=1e-5)
        grads = dict(reference.named_parameters())
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad, grads[n].grad, atol=1e-5, rtol=1e-5, msg=n)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_steady_state_packed_step_reads_nothing_back(dtype):
    """torch.cuda.set_sync_debug_mode("error") around a packed micro-batch's forward, loss and
    backward after warm-up: no operation waits for the device (fp32: the padded varlen SDPA;
    bf16: FlashAttention's varlen kernel where the GPU has it)."""
    device = torch.device("cuda")
    megabert.init_parallel()
    model = BertForPreTraining(_config("varlen"), seed=3, device=device, params_dtype=dtype)
    batches = _three_packings(device)

    def step(batch):
        _global_loss(model(**batch), *_counts(batch)).backward()

    step(batches[0])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for batch in batches[1:]:
            step(batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


@needs_cuda
def test_compile_on_cuda_with_packing_uses_cuda_graphs_and_trains_as_eager():
    """pretrain_bert.py --compile --pack-sequences on CUDA: the layers compile in mode
    "reduce-overhead" (CUDA graph trees) with static shapes and train to eager mode's losses."""
    import torch._dynamo

    from tests.test_packing import _packed_losses

    torch._dynamo.reset()
    one_micro_batch = ["--global-batch-size", "2"]  # CUDA graphs are not used with gradient accumulation
    try:
        eager, _ = _packed_losses(one_micro_batch)
        compiled, graphs = _packed_losses(one_micro_batch + ["--compile"])
        assert compiled == pytest.approx(eager, abs=1e-4, rel=0)
        assert graphs[0] == graphs[-1], graphs  # no recompilation after the first step
    finally:
        torch._dynamo.reset()
