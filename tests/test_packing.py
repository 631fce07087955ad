"""Sequence packing (--pack-sequences): how rows are filled, attention kept inside each sample,
a packed step equal to the same samples unpacked (loss and every gradient, fp32, dropout 0) at
TP=1, TP=2, PP=2 and DP=2 with the distributed optimizer, determinism across loader workers,
and bitwise resume through pretrain_bert.py with dropout on."""
import json

import numpy as np
import pytest
import torch

import megabert
from megabert.config import ModelConfig
from megabert.data.packing import (PACKED_COUNTS, PackingSpec, first_fit_decreasing, pack_window, packed_loader,
                                   packed_micro_batches)
from megabert.errors import DataError
from megabert.tasks.pretraining import BertForPreTraining

from tests.helpers.dist_utils import run_distributed
from tests.helpers.pretrain_runs import curve, pretrain_args, run_ranks
from tests.helpers.train_utils import step_loss

SEQ, VOCAB, CAP = 16, 99, 3
N = 16  # samples of the equivalence step


def sample(i: int) -> dict:
    """Sample i: [CLS] + 2..13 tokens, two masked labels, segment B from the middle, padded to SEQ."""
    g = torch.Generator().manual_seed(1000 + i)
    length = int(torch.randint(3, 15, (1,), generator=g))
    ids = torch.zeros(SEQ, dtype=torch.long)
    ids[:length] = torch.randint(5, VOCAB, (length,), generator=g)
    ids[0] = 2
    labels = torch.full((SEQ,), -100)
    pos = 1 + torch.randperm(length - 1, generator=g)[:2]
    labels[pos] = ids[pos]
    ids[pos] = 4
    tt = torch.zeros(SEQ, dtype=torch.long)
    tt[length // 2:length] = 1
    am = (torch.arange(SEQ) < length).long()
    return {k: v.numpy() for k, v in dict(input_ids=ids, token_type_ids=tt, attention_mask=am, labels=labels,
                                          next_sentence_label=torch.tensor(i % 2)).items()}


SPEC = PackingSpec(seq_length=SEQ, max_samples_per_row=CAP, window=N, seed=5, sample_fields=("next_sentence_label",))
SAMPLES = [sample(i) for i in range(N)]
ROWS = len(pack_window(SAMPLES, 0, SPEC)["row_samples"])


# ------------------------------------------------------------------ the packer


def test_first_fit_decreasing_places_every_sample_once_within_limits():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 60, 500)
    rows = first_fit_decreasing(lengths, 128, 3)
    assert sorted(i for r in rows for i in r) == list(range(500))
    assert all(sum(lengths[i] for i in r) <= 128 and len(r) <= 3 for r in rows)
    assert rows == first_fit_decreasing(lengths, 128, 3)
    # first-fit decreasing on these lengths fills rows to ~95%: far fewer rows than samples
    assert len(rows) < 0.4 * len(lengths)


def test_packed_rows_hold_the_samples_as_they_are():
    w = pack_window(SAMPLES, 0, SPEC)
    seen = []
    for r in range(len(w["row_samples"])):
        at = 0
        for slot, n in enumerate(w["packed_seqlens"][r]):
            if n == 0:
                assert (w["packed_seqlens"][r][slot:] == 0).all() and (w["next_sentence_label"][r][slot:] == -100).all()
                break
            # the first unseen sample with these tokens (two samples may be alike)
            match = [i for i, s in enumerate(SAMPLES) if s["attention_mask"].sum() == n and i not in seen
                     and all((s[k][:n] == w[k][r, at:at + n]).all() for k in ("input_ids", "labels"))]
            assert match
            s = SAMPLES[match[0]]
            for k in ("token_type_ids", "labels"):
                assert (w[k][r, at:at + n] == s[k][:n]).all()
            assert (w["position_ids"][r, at:at + n] == np.arange(n)).all()
            assert w["next_sentence_label"][r, slot] == s["next_sentence_label"]
            seen.append(match[0])
            at += n
        assert w["attention_mask"][r].sum() == at and (w["labels"][r, at:] == -100).all()
    assert sorted(seen) == list(range(N))
    assert ROWS < N * 0.7  # the samples do pack


def test_resume_inside_a_row_is_a_clear_error():
    windows = [pack_window(SAMPLES, 0, SPEC)]
    first = int(windows[0]["row_samples"][0])
    skipped = list(packed_micro_batches(windows, SPEC, first, 1, 0, 1))
    assert len(skipped) == ROWS - 1
    assert int(sum(b[PACKED_COUNTS][0] for b in skipped)) == N - first
    with pytest.raises(DataError, match="falls inside a packed row"):
        inside = min(set(range(1, N)) - set(np.cumsum(windows[0]["row_samples"]).tolist()))
        next(packed_micro_batches(windows, SPEC, inside, 1, 0, 1))


def test_packed_micro_batches_have_fixed_shapes():
    """Every packed micro-batch is the same tensors (shapes and dtypes), whatever its rows hold,
    and so is what the model derives from it without a host value (what CUDA graphs need)."""
    from megabert.model.unpad import TokenLayout

    batches = list(packed_micro_batches([pack_window(SAMPLES, 0, SPEC)], SPEC, 0, 2, 0, 1))
    assert len({tuple((k, tuple(v.shape), v.dtype) for k, v in sorted(b.items())) for b in batches}) == 1
    layouts = [TokenLayout.packed_rows(b["packed_seqlens"], SEQ) for b in batches]
    assert {tuple(t.cu_seqlens.shape) for t in layouts} == {(2 * (CAP + 1) + 1,)}
    assert all(int(t.cu_seqlens[-1]) == 2 * SEQ and t.max_seqlen == SEQ for t in layouts)
    assert len({int(b[PACKED_COUNTS][0]) for b in batches}) > 1  # while the samples per micro-batch vary


# ------------------------------------------------------------------ isolation


@pytest.mark.parametrize("name,cfg", [
    ("reference-padded", dict(attention_backend="torch", unpad_input=False)),
    ("fused-softmax-padded", dict(attention_backend="fused", unpad_input=False)),
    ("sdpa-padded", dict(attention_backend="sdpa", unpad_input=False)),
    ("unpadded-torch", dict(attention_backend="torch", unpad_input=True)),
    ("varlen", dict(attention_backend="varlen", unpad_input=True)),
    ("varlen-fixed-shape", dict(attention_backend="varlen", unpad_input=False)),
])
def test_attention_never_crosses_a_sample_boundary(name, cfg):
    """Perturbing one sample of a packed row leaves every other sample's MLM logits and
    sentence-pair logits bitwise unchanged."""
    megabert.init_parallel()
    config = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=VOCAB,
                         max_position_embeddings=32, hidden_dropout=0.0, attention_dropout=0.0, **cfg)
    model = BertForPreTraining(config, seed=3).eval()
    w = pack_window(SAMPLES, 0, SPEC)
    batch = {k: torch.from_numpy(v) for k, v in w.items() if k not in ("row_samples", "labels",
                                                                          "next_sentence_label")}
    r = int(np.flatnonzero(w["row_samples"] == w["row_samples"].max())[0])  # a row with the most samples
    assert w["row_samples"][r] >= 2
    lengths = w["packed_seqlens"][r]
    victim = slice(int(lengths[0]) + 1, int(lengths[0] + lengths[1]))  # the second sample's tokens after [CLS]
    with torch.no_grad():
        before = model(**batch)
        batch["input_ids"][r, victim] = (batch["input_ids"][r, victim] + 7) % VOCAB
        after = model(**batch)
    keep = torch.ones(SEQ, dtype=torch.bool)
    keep[int(lengths[0]):int(lengths[0] + lengths[1])] = False
    assert torch.equal(before.mlm_logits[r][keep], after.mlm_logits[r][keep])
    others = [i for i in range(len(w["row_samples"])) if i != r]
    assert torch.equal(before.mlm_logits[others], after.mlm_logits[others])
    nsp_b, nsp_a = before.nsp_logits.view(-1, CAP, 2), after.nsp_logits.view(-1, CAP, 2)
    assert torch.equal(nsp_b[r, 0], nsp_a[r, 0]) and torch.equal(nsp_b[others], nsp_a[others])
    assert not torch.equal(nsp_b[r, 1], nsp_a[r, 1])  # the perturbed sample itself did change


# ------------------------------------------------------------------ a packed step = the samples unpacked

TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", str(SEQ),
        "--max-position-embeddings", "32", "--hidden-dropout", "0", "--attention-dropout", "0", "--lr", "1",
        "--adam-eps", "1", "--weight-decay", "0", "--clip-grad", "0", "--log-interval", "1", "--eval-interval", "0",
        "--train-iters", "1", "--mask-prob", "0.25"]  # sample() masks 2 tokens: 3 a row need floor(p x 16) + 3 >= 6


def _step_worker(rank, world, argv, packed, tp, pp, out):
    """One training step on the N samples (packed rows or padded samples); writes this rank's
    metrics, gradients and updated parameters. With lr 1, eps 1 and no weight decay, Adam's
    first update is g / (|g| + 1): the parameters after the step carry the gradients (the
    distributed optimizer keeps only shards of the averaged gradients)."""
    from megabert.arguments import parse_args
    from megabert.tasks.pretraining.task import build_pretraining
    from megabert.training.resolve import resolve_run

    cfg = parse_args(TINY + argv + ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size",
                                    str(pp)])
    ps = megabert.init_parallel(tp, pp)
    run = resolve_run(cfg, ps)
    mbs = cfg.train.micro_batch_size
    if packed:
        data = list(packed_micro_batches([pack_window(SAMPLES, 0, SPEC)], SPEC, 0, mbs, ps.dp_rank, ps.dp_size))
    else:
        data = []
        for start in range(0, N, mbs * ps.dp_size):
            mine = SAMPLES[start + ps.dp_rank * mbs:start + (ps.dp_rank + 1) * mbs]
            data.append({k: torch.from_numpy(np.stack([s[k] for s in mine])) for k in mine[0]})
    trainer = build_pretraining(run, ps, VOCAB, lambda consumed: iter(data))
    try:
        trainer.train_step()
        metrics = trainer.flush_metrics()
        grads = {n: p.grad.clone() for n, p in trainer.strategy.model.named_parameters() if p.grad is not None}
        params = trainer.checkpoint.parts.model.state_dict()  # whole (TP-local) weights, ZeRO-3's gathered
        consumed = int(trainer.step_packing[0]) if trainer.step_packing is not None else N
    finally:
        trainer.close()
    torch.save({"metrics": metrics, "grads": grads, "params": params, "consumed": consumed}, f"{out}.{rank}")


def _compare(tmp_path, world, argv_packed, argv_unpacked, tp=1, pp=1, *, grads=True):
    run_distributed(_step_worker, world, argv_packed, True, tp, pp, str(tmp_path / "packed"))
    run_distributed(_step_worker, world, argv_unpacked, False, tp, pp, str(tmp_path / "unpacked"))
    for rank in range(world):
        p, u = torch.load(tmp_path / f"packed.{rank}"), torch.load(tmp_path / f"unpacked.{rank}")
        assert p["consumed"] == N
        for k in ("lm_loss", "sop_loss", "grad_norm"):
            if k in u["metrics"]:
                assert p["metrics"][k] == pytest.approx(u["metrics"][k], abs=1e-6, rel=0), k
        if grads:
            assert p["grads"].keys() == u["grads"].keys() and p["grads"]
            for n in u["grads"]:
                torch.testing.assert_close(p["grads"][n], u["grads"][n], atol=1e-6, rtol=0, msg=n)
        assert p["params"].keys() == u["params"].keys() and all(v.numel() for v in u["params"].values())
        for n in u["params"]:
            torch.testing.assert_close(p["params"][n], u["params"][n], atol=1e-6, rtol=0, msg=n)


def _batch_args(rows_per_micro, samples_per_micro, dp=1):
    packed = ["--pack-sequences", "--micro-batch-size", str(rows_per_micro), "--global-batch-size", str(ROWS)]
    unpacked = ["--micro-batch-size", str(samples_per_micro), "--global-batch-size", str(N)]
    return packed, unpacked


@pytest.mark.parametrize("name,backend", [
    ("reference", ["--attention-backend", "torch", "--no-unpad-input"]),
    ("varlen", ["--attention-backend", "varlen"]),
    ("varlen-fixed-shape", ["--attention-backend", "varlen", "--no-unpad-input"]),
])
def test_packed_step_equals_unpacked_tp1(tmp_path, name, backend):
    packed, unpacked = _batch_args(1, 4)
    _compare(tmp_path, 1, packed + backend, unpacked + backend)


@pytest.mark.parametrize("name,world,tp,pp,extra", [
    ("tp2", 2, 2, 1, []),
    ("tp2-fixed-shape", 2, 2, 1, ["--no-unpad-input"]),  # the CUDA default (megabert.model.packed)
    ("tp2-sequence-parallel", 2, 2, 1, ["--sequence-parallel", "--no-unpad-input"]),
    ("pp2", 2, 1, 2, []),
    ("pp2-fixed-shape", 2, 1, 2, ["--no-unpad-input"]),
    ("pp2-interleaved", 2, 1, 2, ["--num-layers", "4", "--num-layers-per-virtual-pipeline-stage", "1"]),
    ("dp2-distributed-optimizer", 2, 1, 1, ["--use-distributed-optimizer"]),
    ("dp2-zero2", 2, 1, 1, ["--deepspeed", "--zero-stage", "2"]),
    ("dp2-zero3", 2, 1, 1, ["--deepspeed", "--zero-stage", "3"]),
])
def test_packed_step_equals_unpacked_across_layouts(tmp_path, name, world, tp, pp, extra):
    dp = world // (tp * pp)
    packed, unpacked = _batch_args(1, 4 // dp, dp)
    # The distributed optimizer and ZeRO keep only shards of the averaged gradients: there the
    # updated parameters carry them (see _step_worker).
    _compare(tmp_path, world, packed + extra, unpacked + extra, tp, pp,
             grads="--use-distributed-optimizer" not in extra and "--deepspeed" not in extra)


# ------------------------------------------------------------------ the real data path


def _bert_samples(d, n, seq=32):
    from megabert.config import DataConfig
    from megabert.data import build_tokenizer
    from megabert.tasks.pretraining.indexed_splits import build_train_valid_test_datasets

    data = DataConfig(data_path=[str(d / "c_text_sentence")], vocab_file=str(d / "vocab.txt"), split="90,10,0",
                      seq_length=seq)
    tokenizer = build_tokenizer(data.tokenizer_type, data.vocab_file)
    return build_train_valid_test_datasets(data, tokenizer, (n, 0, 0), 1234, True)[0]


def test_packing_is_the_same_for_any_number_of_workers(dataset):
    """The packed micro-batches of every data-parallel rank, from the start and from a resume
    point, are the same with 0, 1 and 2 DataLoader workers."""
    ds = _bert_samples(dataset, 200)
    spec = PackingSpec(seq_length=32, max_samples_per_row=CAP, window=24, seed=1234,
                       sample_fields=("next_sentence_label",))

    def stream(workers, consumed, dp_rank):
        out = packed_micro_batches(packed_loader(ds, spec, consumed, workers), spec, consumed, 2, dp_rank, 2)
        return [next(out) for _ in range(12)]

    reference = {(c, r): stream(0, c, r) for c, r in ((0, 0), (0, 1))}
    counts = [int(b[PACKED_COUNTS][0]) for b in reference[0, 0]]
    assert sum(counts) > 12 * 4  # more than one sample per row
    resume_at = sum(counts[:5])  # after five micro-steps: the samples a checkpoint would count
    reference[resume_at, 0] = stream(0, resume_at, 0)
    for a, b in zip(reference[resume_at, 0], reference[0, 0][5:]):
        assert all(torch.equal(a[k], b[k]) for k in b)
    for workers in (1, 2):
        for (c, r), expected in reference.items():
            got = stream(workers, c, r)
            assert all(torch.equal(g[k], e[k]) for g, e in zip(got, expected) for k in e), (workers, c, r)


COMMON = ["--pack-sequences", "--packing-window", "16", "--short-seq-prob", "0.8", "--train-iters", "6", "--hidden-dropout", "0.1",
          "--attention-dropout", "0.1"]


def test_resume_with_packing_is_bitwise_with_dropout(dataset, tmp_path):
    """pretrain_bert.py --pack-sequences stopped at iteration 3 and resumed (with another number
    of loader workers) gives the uninterrupted run's losses exactly; every line reports the
    packing (real_token_share, samples_per_row)."""
    full, part, ckpt = tmp_path / "full.jsonl", tmp_path / "part.jsonl", str(tmp_path / "ckpt")
    run_ranks(1, pretrain_args(dataset, full, *COMMON))
    run_ranks(1, pretrain_args(dataset, part, *COMMON, "--save", ckpt, "--exit-interval", "3"))
    run_ranks(1, pretrain_args(dataset, part, *COMMON, "--save", ckpt, "--load", ckpt, "--num-workers", "2"))
    expected = curve(full)
    assert {it for it, _, _ in expected} == {1, 2, 3, 4, 5, 6}
    assert any(key == "valid_lm_loss" for _, key, _ in expected)
    assert curve(part) == expected
    rows = [r for r in map(json.loads, open(full)) if "grad_norm" in r]
    assert len(rows) == 6 and all(0 < r["real_token_share"] <= 1 and r["samples_per_row"] >= 1 for r in rows)
    assert sum(r["samples_per_row"] for r in rows) > 6  # the short samples did pack


def test_data_parallel_ranks_share_the_packed_stream(dataset, tmp_path):
    """pretrain_bert.py --pack-sequences at DP=2 trains on the rows of DP=1 (fp32, dropout 0): the
    same losses, evaluation included, and the same samples consumed."""
    plain = ["--pack-sequences", "--packing-window", "16", "--short-seq-prob", "0.8", "--train-iters", "4",
             "--hidden-dropout", "0", "--attention-dropout", "0"]
    one, two = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
    run_ranks(1, pretrain_args(dataset, one, *plain))
    run_ranks(2, pretrain_args(dataset, two, *plain))
    expected, got = curve(one), curve(two)
    assert [(i, k) for i, k, _ in got] == [(i, k) for i, k, _ in expected]
    assert [v for _, _, v in got] == pytest.approx([v for _, _, v in expected], abs=1e-5)


def _unpack(window: dict) -> list[tuple]:
    """Each sample of packed rows as (tokens, token types, labels, sentence label), row by row."""
    out = []
    for r in range(len(window["row_samples"])):
        at = 0
        for slot, n in enumerate(window["packed_seqlens"][r]):
            n = int(n)
            if n == 0:
                break
            out.append((tuple(window["input_ids"][r, at:at + n]), tuple(window["token_type_ids"][r, at:at + n]),
                        tuple(window["labels"][r, at:at + n]), int(window["next_sentence_label"][r, slot])))
            assert (window["position_ids"][r, at:at + n] == np.arange(n)).all()
            at += n
    return out


def _as_tuple(s: dict) -> tuple:
    n = int(s["attention_mask"].sum())
    return (tuple(s["input_ids"][:n]), tuple(s["token_type_ids"][:n]), tuple(s["labels"][:n]),
            int(s["next_sentence_label"]))


@pytest.mark.parametrize("kind,sub,seq", [
    ("dle_hdf5", None, 128),
    ("lddl_dynamic", "phase1_dynamic", 128),
    ("lddl_binned", "phase2_static_binned", 512),
])
def test_nvidia_shards_pack_sample_for_sample(kind, sub, seq):
    """DLE HDF5 and LDDL shards (binned too) through the reader pretrain_bert.py uses: a packed
    window holds exactly the window's samples as the unpacked loader gives them."""
    import os

    from megabert.config import DataConfig
    from megabert.data import build_tokenizer
    from megabert.tasks.pretraining.batches import packing_spec
    from megabert.data.shard_sources import detect_nvidia_data
    from megabert.tasks.pretraining.nvidia_samples import build_nvidia_datasets
    from tests.helpers.nvidia_shards import DLE_PHASE1, LDDL, NVIDIA_VOCAB

    path = DLE_PHASE1 if sub is None else os.path.join(LDDL, sub)
    data = DataConfig(data_path=[path], vocab_file=NVIDIA_VOCAB, seq_length=seq, binary_head_task="nsp",
                      pack_sequences=True, packing_window=32)
    train, _ = build_nvidia_datasets(detect_nvidia_data(data.data_path), data,
                                     build_tokenizer(data.tokenizer_type, data.vocab_file), (64, 0, 0), 1234, 4, True)
    spec = packing_spec(data, 1234)
    for k in (0, 1):
        window = pack_window(train, k, spec)
        assert sorted(_unpack(window)) == sorted(_as_tuple(train[i]) for i in range(32 * k, 32 * (k + 1)))
        assert len(window["row_samples"]) < 32  # rows hold several samples


# ------------------------------------------------------------------ --compile


def _packed_losses(argv, steps=4):
    """lm_loss of `steps` steps on packed rows of 64 samples, through pretrain_bert.py's trainer."""
    from megabert.arguments import parse_args
    from megabert.tasks.pretraining.task import build_pretraining
    from megabert.training.resolve import resolve_run

    cfg = parse_args(TINY + ["--pack-sequences", "--micro-batch-size", "2", "--global-batch-size", "4",
                             "--train-iters", str(steps), "--lr", "1e-3", "--adam-eps", "1e-6"] + argv)
    ps = megabert.init_parallel()
    spec = PackingSpec(seq_length=SEQ, max_samples_per_row=CAP, window=64, seed=5,
                       sample_fields=("next_sentence_label",))
    samples = [sample(i) for i in range(64)]
    data = packed_micro_batches([pack_window(samples, 0, spec)], spec, 0, 2, 0, 1)
    trainer = build_pretraining(resolve_run(cfg, ps), ps, VOCAB, lambda consumed: data)
    graphs = []
    try:
        losses = []
        for _ in range(steps):
            losses.append(step_loss(trainer))
            graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
        return losses, graphs
    finally:
        trainer.close()


def test_compile_with_packing_one_graph_no_recompile():
    """--compile on packed rows: the eager losses (fp32, BERT's hidden and attention dropout on),
    no graph break (at TP=1 attention dropout draws from the default stream: no RNG swap in the
    layer), and every graph compiled in the first step (the layers and the last layer at the
    heads' positions): later steps, whose rows hold other numbers of samples and tokens, reuse them."""
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    try:
        dropout = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
        eager, _ = _packed_losses(dropout)
        compiled, graphs = _packed_losses(dropout + ["--compile"])
        assert compiled == pytest.approx(eager, abs=1e-5, rel=0)
        assert sum(torch._dynamo.utils.counters["graph_break"].values()) == 0
        assert graphs[0] == graphs[-1] == 2, graphs
    finally:
        torch._dynamo.reset()


# ------------------------------------------------------------------ GLUE


@pytest.mark.parametrize("num_labels", [3, 1])
def test_glue_packed_rows_equal_the_features_unpacked(num_labels):
    """BertForSequenceClassification on packed rows: each feature's logits from its own [CLS]
    (to fp32 rounding), and the loss over the batch's features and every gradient equal the
    unpacked batch's (classification, and STS-B's regression: 1 output)."""
    from megabert.tasks.glue.model import BertForSequenceClassification

    megabert.init_parallel()
    config = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=VOCAB,
                         max_position_embeddings=32, hidden_dropout=0.0, attention_dropout=0.0, num_labels=num_labels,
                         unpad_input=True)
    model = BertForSequenceClassification(config, seed=3)
    feats = [{k: v for k, v in s.items() if k in ("input_ids", "token_type_ids", "attention_mask")} for s in SAMPLES]
    for i, f in enumerate(feats):
        f["labels"] = np.array(i % 3, dtype=np.int64) if num_labels > 1 else np.array(i / 5, dtype=np.float32)
    spec = PackingSpec(seq_length=SEQ, max_samples_per_row=CAP, window=N, seed=5, sample_fields=("labels",))
    window = pack_window(feats, 0, spec)
    packed = {k: torch.from_numpy(v) for k, v in window.items() if k != "row_samples"}
    unpacked = {k: torch.from_numpy(np.stack([f[k] for f in feats])) for k in feats[0]}

    def run(batch):
        model.zero_grad()
        out = model(**batch)
        (out.loss_sum / N).backward()
        return out, {n: p.grad.clone() for n, p in model.named_parameters()}

    (p_out, p_grads), (u_out, u_grads) = run(packed), run(unpacked)
    torch.testing.assert_close(p_out.loss, u_out.loss, atol=1e-6, rtol=1e-6)
    for n in u_grads:
        torch.testing.assert_close(p_grads[n], u_grads[n], atol=1e-6, rtol=0, msg=n)
    # each slot's logits are its feature's (alike features are interchangeable)
    order = []
    for r, lengths in enumerate(window["packed_seqlens"]):
        at = 0
        for n in map(int, lengths[lengths > 0]):
            tokens = window["input_ids"][r, at:at + n]
            order.append(next(i for i, f in enumerate(feats) if i not in order and f["attention_mask"].sum() == n
                              and (f["input_ids"][:n] == tokens).all()))
            at += n
    real = (packed["packed_seqlens"].reshape(-1) > 0).nonzero().flatten()
    torch.testing.assert_close(p_out.logits[real], u_out.logits[order], atol=1e-5, rtol=1e-5)
