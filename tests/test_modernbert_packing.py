"""--pack-sequences with ModernBERT (MLM only): each packed sample keeps its own RoPE positions
from 0 and no attention (global, or a local window) crosses a sample boundary. A packed row's
logits equal its samples run one by one; perturbing one sample leaves every other sample's
logits bitwise unchanged; a packed training step (pretrain_bert.py's trainer, 30% masking)
equals the same samples unpacked, loss and every gradient (fp32, dropout 0), at TP 1 and 2
(with sequence parallelism too) and PP 2."""
import numpy as np
import pytest
import torch

import megabert
from megabert.data.packing import PackingSpec, pack_window, packed_micro_batches

from tests.helpers.dist_utils import run_distributed

SEQ, VOCAB, CAP, WINDOW = 32, 99, 3, 8  # local layers see 4 tokens each side: windows inside samples matter
N = 12  # samples of the equivalence step


def sample(i: int) -> dict:
    """Sample i: [CLS] + 4..27 tokens + [SEP], 30% of its inner tokens masked, padded to SEQ."""
    g = torch.Generator().manual_seed(2000 + i)
    length = int(torch.randint(6, 30, (1,), generator=g))
    ids = torch.zeros(SEQ, dtype=torch.long)
    ids[:length] = torch.randint(5, VOCAB, (length,), generator=g)
    ids[0], ids[length - 1] = 1, 2
    labels = torch.full((SEQ,), -100)
    pos = 1 + torch.randperm(length - 2, generator=g)[:max(1, round(0.3 * (length - 2)))]
    labels[pos] = ids[pos]
    ids[pos] = 3
    am = (torch.arange(SEQ) < length).long()
    return {k: v.numpy() for k, v in dict(input_ids=ids, token_type_ids=torch.zeros_like(ids), attention_mask=am,
                                          labels=labels).items()}


SPEC = PackingSpec(seq_length=SEQ, max_samples_per_row=CAP, window=N, seed=5)
SAMPLES = [sample(i) for i in range(N)]
WINDOW_ROWS = pack_window(SAMPLES, 0, SPEC)
ROWS = len(WINDOW_ROWS["row_samples"])

LAYOUTS = [
    ("reference-padded", dict(attention_backend="torch", unpad_input=False)),
    ("sdpa-padded", dict(attention_backend="sdpa", unpad_input=False)),
    ("fused-padded", dict(attention_backend="fused", unpad_input=False)),
    ("unpadded-torch", dict(attention_backend="torch", unpad_input=True)),
    ("unpadded-sdpa", dict(attention_backend="sdpa", unpad_input=True)),
    ("varlen", dict(attention_backend="varlen", unpad_input=True)),
    ("varlen-fixed-shape", dict(attention_backend="varlen", unpad_input=False)),
]


def _model(**cfg):
    megabert.init_parallel()
    # 3 layers: global, local, local (global_attn_every_n_layers 3), window 8 < the longer samples.
    config = megabert.modernbert_tiny(num_layers=3, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48,
                                      vocab_size=VOCAB, max_position_embeddings=64, local_attention=WINDOW,
                                      mlm_logits_at_masked_only=False, **cfg)
    return megabert.ModernBertForMaskedLM(config, seed=3).eval()


def _packed_batch():
    w = WINDOW_ROWS
    return {k: torch.from_numpy(v) for k, v in w.items() if k not in ("row_samples", "labels")}


def _samples_of_rows():
    """(row, start, length) of every packed sample, in row order."""
    out = []
    for r, lengths in enumerate(WINDOW_ROWS["packed_seqlens"]):
        start = 0
        for length in lengths[lengths > 0]:
            out.append((r, start, int(length)))
            start += int(length)
    return out


def _find_sample(ids: torch.Tensor) -> int:
    """The sample whose tokens are `ids` (each sample's tokens are distinct here)."""
    hits = [i for i, s in enumerate(SAMPLES) if int(s["attention_mask"].sum()) == len(ids)
            and np.array_equal(s["input_ids"][:len(ids)], ids.numpy())]
    assert len(hits) == 1
    return hits[0]


@pytest.mark.parametrize("name,cfg", [LAYOUTS[0], LAYOUTS[5]])
def test_rope_positions_restart_at_every_sample(name, cfg):
    """The positions RoPE rotates by are each sample's from 0 (the packer's position_ids), not
    the row's slots. (RoPE scores depend on q - k alone, so within a sample any offset gives the
    same logits up to rounding: the positions are checked here, the logits below.)"""
    model = _model(**cfg)
    batch = _packed_batch()
    bert = model.bert
    tokens = bert._token_layout(batch["input_ids"], batch["attention_mask"], batch["packed_seqlens"])
    hidden = torch.zeros(SEQ, ROWS, 32)
    positions = bert._inputs(hidden, batch["attention_mask"], tokens, batch["packed_seqlens"]).rope.positions
    want = tokens.unpad(batch["position_ids"].t().contiguous())  # [T] in the layout's order
    real = tokens.unpad(batch["attention_mask"].t().contiguous()).bool()
    assert torch.equal(positions[real], want[real])
    assert int(positions.max()) < int(batch["packed_seqlens"].max())  # not a row slot


@pytest.mark.parametrize("name,cfg", LAYOUTS)
def test_packed_rows_equal_their_samples_alone(name, cfg):
    """Every packed sample's logits equal that sample's logits run alone in a padded row: RoPE
    counts each sample from 0 and no attention reaches another sample or the padding."""
    model = _model(**cfg)
    batch = _packed_batch()
    with torch.no_grad():
        packed = model(**batch).logits  # [rows, SEQ, V]
        for r, start, length in _samples_of_rows():
            ids = batch["input_ids"][r, start:start + length]
            i = _find_sample(ids)
            alone = model(torch.from_numpy(SAMPLES[i]["input_ids"])[None],
                          attention_mask=torch.from_numpy(SAMPLES[i]["attention_mask"])[None]).logits[0, :length]
            torch.testing.assert_close(packed[r, start:start + length], alone, atol=1e-5, rtol=0,
                                       msg=f"{name}: row {r} sample at {start}")


@pytest.mark.parametrize("name,cfg", LAYOUTS)
def test_attention_never_crosses_a_sample_boundary(name, cfg):
    """Perturbing one sample of a packed row leaves every other sample's logits bitwise unchanged."""
    model = _model(**cfg)
    batch = _packed_batch()
    w = WINDOW_ROWS
    r = int(np.flatnonzero(w["row_samples"] == w["row_samples"].max())[0])  # a row with the most samples
    assert w["row_samples"][r] >= 2
    lengths = w["packed_seqlens"][r]
    victim = slice(int(lengths[0]) + 1, int(lengths[0] + lengths[1]) - 1)  # the second sample's inner tokens
    with torch.no_grad():
        before = model(**batch).logits
        batch["input_ids"][r, victim] = (batch["input_ids"][r, victim] + 7) % VOCAB
        after = model(**batch).logits
    real = torch.arange(SEQ) < int(lengths.sum())
    keep = real.clone()
    keep[int(lengths[0]):int(lengths[0] + lengths[1])] = False
    assert torch.equal(before[r][keep], after[r][keep])
    others = [i for i in range(ROWS) if i != r]
    others_real = torch.from_numpy(w["attention_mask"][others]).bool()
    assert torch.equal(before[others][others_real], after[others][others_real])
    changed = ~keep & real
    assert not torch.equal(before[r][changed], after[r][changed])  # the perturbed sample itself did change


def test_padded_layout_positions_and_segments_are_each_samples():
    """Sequence parallelism keeps packed rows in the padded [s, b] layout: RoPE's positions are
    the packer's position_ids (each sample's from 0) and each position's segment is its sample's
    slot, the padding after them one more segment."""
    from megabert.model.packed import sample_positions, sample_segments

    batch = _packed_batch()
    real = batch["attention_mask"].bool()
    positions = sample_positions(batch["packed_seqlens"], SEQ)
    assert torch.equal(positions[real], batch["position_ids"][real])
    segments = sample_segments(batch["packed_seqlens"], SEQ)
    for r, start, length in _samples_of_rows():
        slot = int(segments[r, start])
        assert (segments[r, start:start + length] == slot).all() and (segments[r, :start] < slot).all()
    assert (segments[~real] == CAP).all()


# ------------------------------------------------------------------ a packed step = the samples unpacked

TINY = ["--model-family", "modernbert", "--num-layers", "3", "--hidden-size", "32", "--num-attention-heads", "4",
        "--ffn-hidden-size", "48", "--local-attention", str(WINDOW), "--seq-length", str(SEQ),
        "--max-position-embeddings", "64", "--lr", "1", "--adam-eps", "1", "--weight-decay", "0", "--clip-grad", "0",
        "--log-interval", "1", "--eval-interval", "0", "--train-iters", "1"]


def _step_worker(rank, world, argv, packed, tp, pp, out):
    """One training step on the N samples (packed rows or padded samples); writes this rank's
    metrics and gradients (see tests/test_packing.py's worker)."""
    from megabert.arguments import parse_args
    from megabert.tasks.pretraining.task import build_pretraining
    from megabert.training.resolve import resolve_run

    cfg = parse_args(TINY + argv + ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size",
                                    str(pp)])
    ps = megabert.init_parallel(tp, pp)
    run = resolve_run(cfg, ps)
    assert run.model.model_family == "modernbert" and run.data.mask_prob == pytest.approx(0.3)
    mbs = cfg.train.micro_batch_size
    if packed:
        data = list(packed_micro_batches([pack_window(SAMPLES, 0, SPEC)], SPEC, 0, mbs, ps.dp_rank, ps.dp_size))
    else:
        data = [{k: torch.from_numpy(np.stack([s[k] for s in SAMPLES[start:start + mbs]])) for k in SAMPLES[0]}
                for start in range(0, N, mbs)]
    trainer = build_pretraining(run, ps, VOCAB, lambda consumed: iter(data))
    try:
        trainer.train_step()
        metrics = trainer.flush_metrics()
        grads = {n: p.grad.clone() for n, p in trainer.strategy.model.named_parameters() if p.grad is not None}
        consumed = int(trainer.step_packing[0]) if trainer.step_packing is not None else N
    finally:
        trainer.close()
    torch.save({"metrics": metrics, "grads": grads, "consumed": consumed}, f"{out}.{rank}")


@pytest.mark.parametrize("name,tp,pp,extra", [
    ("tp1-varlen", 1, 1, ["--attention-backend", "varlen"]),
    ("tp1-reference-padded", 1, 1, ["--attention-backend", "torch", "--no-unpad-input"]),
    ("tp1-varlen-fixed-shape", 1, 1, ["--attention-backend", "varlen", "--no-unpad-input"]),
    ("tp2-varlen", 2, 1, ["--attention-backend", "varlen"]),
    ("tp2-sdpa-padded", 2, 1, ["--attention-backend", "sdpa", "--no-unpad-input"]),
    # Sequence parallelism: the padded layout split over TP, the local layers by blocks with
    # each sample a segment (sdpa), or under the band and block-diagonal masks (torch).
    ("tp2-sp-blocked", 2, 1, ["--sequence-parallel", "--attention-backend", "sdpa"]),
    ("tp2-sp-reference", 2, 1, ["--sequence-parallel", "--attention-backend", "torch"]),
    ("pp2-varlen", 1, 2, ["--attention-backend", "varlen", "--num-layers", "4"]),
])
def test_packed_step_equals_unpacked(tmp_path, name, tp, pp, extra):
    packed = ["--pack-sequences", "--micro-batch-size", "1", "--global-batch-size", str(ROWS)]
    unpacked = ["--micro-batch-size", "4", "--global-batch-size", str(N)]
    world = tp * pp
    run_distributed(_step_worker, world, packed + extra, True, tp, pp, str(tmp_path / "packed"))
    run_distributed(_step_worker, world, unpacked + extra, False, tp, pp, str(tmp_path / "unpacked"))
    for rank in range(world):
        p, u = torch.load(tmp_path / f"packed.{rank}"), torch.load(tmp_path / f"unpacked.{rank}")
        assert p["consumed"] == N
        assert "sop_loss" not in p["metrics"] and "nsp_loss" not in p["metrics"]  # MLM only
        assert rank < world - 1 or "lm_loss" in u["metrics"]  # the last stage logs the loss
        for k in ("lm_loss", "grad_norm"):
            if k in u["metrics"]:
                assert p["metrics"][k] == pytest.approx(u["metrics"][k], abs=1e-6, rel=0), k
        assert p["grads"].keys() == u["grads"].keys() and p["grads"]
        for n in u["grads"]:
            torch.testing.assert_close(p["grads"][n], u["grads"][n], atol=1e-6, rtol=0, msg=n)
