"""The communication ledger (megabert.parallel.comm): each primitive counts the bytes a
rank sends under the ring algorithms; the per-group totals of tiny TP2 (+SP), DP2 (overlapped
reducer or not), PP2 (1F1B, interleaved) and ZeRO-2 steps match the layout planner's
prediction; DeepSpeed's backend is counted as `zero`.

One spawned world of two serves every multi-process check (module fixture)."""
import json
import os

import pytest
import torch

from megabert.parallel import comm
from megabert.parallel.comm import CommLedger, sent_bytes

from tests.helpers.dist_utils import run_distributed


ITERS = ["--train-iters", "2", "--global-batch-size", "8", "--no-unpad-input"]  # padded encoder: [s, b, h] as the planner counts
# planner field -> the ledger's labels it covers
FIELDS = {"tensor_parallel": ("tp", "sp"), "pipeline_parallel": ("pp",), "data_parallel": ("dp", "zero"),
          "embedding_sync": ("embedding",)}


def test_sent_bytes_are_the_ring_volumes():
    assert sent_bytes("all_reduce", 1000, 4) == 1500  # 2(n-1)/n
    assert sent_bytes("all_gather", 1000, 4) == sent_bytes("reduce_scatter", 1000, 4) == 750  # (n-1)/n
    assert sent_bytes("send", 1000, 2) == 1000 and sent_bytes("recv", 1000, 2) == 0
    assert sent_bytes("all_reduce", 1000, 1) == 0  # a group of one sends nothing


class _FakeBackend:
    """deepspeed.comm's backend as DoorBackend sees it (records, moves nothing)."""

    def __init__(self):
        self.calls = []

    def get_rank(self, group=None):
        return 0

    def get_world_size(self, group=None):
        return 2

    def __getattr__(self, name):
        return lambda *a, **k: self.calls.append(name)


def test_deepspeed_backend_is_counted_as_zero():
    from megabert.training.deepspeed.door_backend import DoorBackend

    fake = _FakeBackend()
    backend = DoorBackend(fake, timeout=None)
    x = torch.zeros(100)  # 400 bytes
    backend.all_reduce(x, group=None)  # uncounted: no ledger active
    ledger = CommLedger()
    with ledger.recording():
        backend.all_reduce(x, torch.distributed.ReduceOp.SUM, None, False)  # positional, as deepspeed.comm
        backend.reduce_scatter_tensor(torch.zeros(50), x, group=None)
        backend.all_gather_into_tensor(x, torch.zeros(50), group=None)
        backend.reduce(x, 1, group=None)  # one partition's reduce: its share of a reduce-scatter
        backend.broadcast(x, 1, None)  # another rank's broadcast: this rank sends nothing
        backend.get_world_size()
    assert fake.calls == ["all_reduce"] * 2 + ["reduce_scatter_tensor", "all_gather_into_tensor", "reduce", "broadcast"]
    assert ledger.take() == {"zero": 400 + 200 + 200 + 200}


def _primitives(rank, ps):
    """{name: (bytes counted on this rank, by label)} for each primitive alone."""
    from megabert.tensor_parallel import mappings

    ledger = CommLedger.for_state(ps)
    out = {}

    def counted(name, fn):
        with ledger.recording():
            fn()
        out[name] = ledger.take()

    counted("all_reduce", lambda: comm.all_reduce(torch.ones(10), group=ps.tp_group))  # 40 B
    counted("all_gather", lambda: comm.all_gather([torch.empty(3), torch.empty(3)], torch.ones(3), group=ps.tp_group))
    # gloo has no reduce-scatter: the SP mapping all-reduces, counted as the reduce-scatter it stands for.
    counted("sp_reduce_scatter", lambda: mappings._reduce_scatter(torch.ones(4, 2), 0, ps.tp_group))
    counted("mp_all_reduce", lambda: comm.all_reduce(torch.ones(2, dtype=torch.float64), group=ps.mp_group))

    def p2p():
        if rank == 0:
            comm.isend(torch.ones(25), 1, group=ps.tp_group).wait()
        else:
            comm.irecv(torch.empty(25), 0, group=ps.tp_group).wait()
    counted("p2p", p2p)
    comm.all_reduce(torch.ones(10), group=ps.tp_group)  # no ledger active: not counted
    out["outside"] = ledger.take()
    return out


def _layout_step(argv, tp):
    """(JSONL rows of a 2-step run, the planner's CommEstimate) for the tiny model."""
    import dataclasses

    from tests.helpers.train_utils import VOCAB, build_trainer

    from megabert.planning import communication
    from megabert.planning.preflight import run_and_layout
    from megabert.training.resolve import resolve_run

    cfg, ps, trainer = build_trainer(ITERS + argv, tp)
    try:
        trainer.train()
    finally:
        trainer.close()
    run = resolve_run(cfg, ps)
    work, layout = run_and_layout(run, "cpu")
    predicted = communication(dataclasses.replace(run.model, vocab_size=VOCAB), work, layout)
    return {k: getattr(predicted, k) for k in FIELDS}


def _worker(rank, world, out_dir):
    import megabert

    ps = megabert.init_parallel(tensor_parallel_size=2)
    results = {"primitives": _primitives(rank, ps), "layouts": {}}
    for name, argv, tp in (("tp2", [], 2), ("dp2", [], 1), ("dp2-no-overlap", ["--no-overlap-grad-reduce"], 1),
                           ("tp2-sp", ["--sequence-parallel"], 2),
                           ("pp2", ["--pipeline-model-parallel-size", "2"], 1),
                           ("pp2-interleaved", ["--pipeline-model-parallel-size", "2", "--num-layers", "4",
                                                "--num-layers-per-virtual-pipeline-stage", "1"], 1),
                           ("zero2", ["--deepspeed", "--zero-stage", "2"], 1)):
        metrics = os.path.join(out_dir, f"{name}.jsonl")
        predicted = _layout_step(argv + ["--metrics-file", metrics], tp)
        results["layouts"][name] = predicted
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    out = tmp_path_factory.mktemp("comm")
    run_distributed(_worker, 2, str(out))
    ranks = [json.load(open(out / f"rank{r}.json")) for r in range(2)]
    rows = {name: [json.loads(x) for x in open(out / f"{name}.jsonl")] for name in ranks[0]["layouts"]}
    return ranks, rows


def test_each_primitive_counts_what_the_rank_sends(world2):
    ranks, _ = world2
    for r, res in enumerate(ranks):
        p = res["primitives"]
        assert p["all_reduce"] == {"tp": 40.0}  # 2 (n-1)/n x 40 B
        assert p["all_gather"] == {"tp": 12.0}  # (n-1)/n x the 24 B gathered
        assert p["sp_reduce_scatter"] == {"sp": 16.0}  # (n-1)/n x 32 B, though gloo all-reduces
        assert p["mp_all_reduce"] == {"mp": 16.0}
        assert p["p2p"] == ({"tp": 100.0} if r == 0 else {})  # the sender counts, the receiver not
        assert p["outside"] == {}


@pytest.mark.parametrize("name", ["tp2", "tp2-sp", "dp2", "dp2-no-overlap", "pp2", "pp2-interleaved", "zero2"])
def test_step_bytes_match_the_planner(world2, name):
    ranks, rows = world2
    predicted = ranks[0]["layouts"][name]
    train = [r for r in rows[name] if "lm_loss" in r]
    assert len(train) == 2
    for row in train:
        by_group = row["comm_gb_by_group"]
        for field, labels in FIELDS.items():
            measured = sum(by_group.get(k, 0.0) for k in labels) * 1e9
            assert measured == pytest.approx(predicted[field], rel=0.05), (field, by_group, predicted)
        # What the planner leaves out (grad norm, loss averaging, cross-entropy's per-token
        # sums) is small: the total is the sum of its fields within 5%.
        assert row["comm_gb"] * 1e9 == pytest.approx(sum(predicted.values()), rel=0.05), (row, predicted)
