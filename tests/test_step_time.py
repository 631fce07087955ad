"""The planner's step time (megabert.planning.step_time): which groups cross a node for the
rank order the trainer builds, how much of the DP reduction the overlap hides, the pipeline
bubble, FLOPs against the modules' own count, ranking by step time, and the CLI. The
prediction against steps measured across a shaped link is bench/multinode.py's (root)."""
import pytest
import torch

from megabert.config import ModelConfig
from megabert.presets import bert_large
from megabert.errors import ConfigError
from megabert.parallel.state import rank_of
from megabert.planning import Layout, Workload, communication, plan
from megabert.planning.step_time import (Links, bubble, compute_time, crosses_nodes, dp_exposed, step_flops,
                                         step_time)

from tests.helpers.cli_utils import run_main


GBIT = 1e9 / 8  # bytes per second of one Gbit/s


def _groups(tp, dp, pp):
    """The TP, DP and PP groups as lists of global ranks (megabert.parallel.state's order)."""
    ranks = lambda t, d, p: rank_of(t, d, p, tp, dp)  # noqa: E731
    return {"tp": [[ranks(t, d, p) for t in range(tp)] for d in range(dp) for p in range(pp)],
            "dp": [[ranks(t, d, p) for d in range(dp)] for t in range(tp) for p in range(pp)],
            "pp": [[ranks(t, d, p) for p in range(pp)] for t in range(tp) for d in range(dp)]}


@pytest.mark.parametrize("tp,dp,pp,per_node", [(8, 2, 1, 8), (2, 4, 1, 8), (2, 8, 4, 8), (4, 2, 2, 8), (1, 2, 1, 1),
                                               (2, 2, 2, 4), (1, 16, 1, 8)])
def test_crossing_groups_follow_the_trainers_rank_order(tp, dp, pp, per_node):
    cross = crosses_nodes(Layout(tp=tp, dp=dp, pp=pp), per_node)
    for axis, groups in _groups(tp, dp, pp).items():
        spans = any(len({r // per_node for r in g}) > 1 for g in groups)
        assert cross[axis] == spans, (axis, tp, dp, pp, per_node)


def test_overlap_hides_all_but_the_last_bucket_given_a_long_enough_backward():
    assert dp_exposed(1.0, window_s=10.0, buckets=4) == pytest.approx(0.25)  # only the last bucket
    assert dp_exposed(1.0, window_s=0.0, buckets=4) == pytest.approx(1.0)  # no backward left to hide under
    assert dp_exposed(1.0, window_s=10.0, buckets=1) == pytest.approx(1.0)  # one bucket: nothing overlaps
    # Between the two: the reduction outlasts the window by D - W (1 - 1/n).
    assert dp_exposed(1.0, window_s=0.8, buckets=4) == pytest.approx(1.0 - 0.8 * 0.75)


def _tiny():
    return ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, vocab_size=512, max_position_embeddings=128)


def test_step_is_compute_plus_exposed_communication_at_each_links_bandwidth():
    model, run = _tiny(), Workload(seq_length=32, micro_batch_size=4, global_batch_size=16)
    links = Links(gpus_per_node=1, intra_gbit=100.0, inter_gbit=1.0)  # every group crosses at 1 Gbit/s
    for layout in (Layout(tp=2), Layout(pp=2), Layout(dp=2), Layout(tp=2, pp=2, dp=2)):
        comm = communication(model, run, layout)
        off = step_time(model, Workload(seq_length=32, micro_batch_size=4, global_batch_size=16,
                                        overlap_grad_reduce=False), layout, links, 0.5)
        assert off.tp_s == pytest.approx(comm.tensor_parallel / GBIT)
        assert off.dp_s == pytest.approx(comm.data_parallel / GBIT)
        assert off.pp_s == pytest.approx(comm.pipeline_parallel / GBIT)
        assert off.embedding_s == pytest.approx(comm.embedding_sync / GBIT)
        # Buckets of 10k elements (the tiny model would fill one default bucket, which overlaps nothing).
        on = step_time(model, run, layout, links, 0.5, bucket_elements=10_000)
        assert on.total_s == pytest.approx(0.5 + on.exposed_s)
        assert off.tp_s + off.embedding_s <= off.exposed_s <= off.comm_s + 1e-12
        if layout.dp > 1:  # the overlap hides DP time, and only DP time
            assert on.exposed_s < off.exposed_s and on.hidden_s > 0
        else:
            assert on.exposed_s == pytest.approx(off.exposed_s)
    # On one node every group uses the fast link: ten times the bandwidth, a tenth the time.
    one_node = step_time(model, run, Layout(dp=2), Links(gpus_per_node=2, intra_gbit=10.0, inter_gbit=1.0), 0.5)
    two_nodes = step_time(model, run, Layout(dp=2), Links(gpus_per_node=1, intra_gbit=10.0, inter_gbit=1.0), 0.5)
    assert one_node.dp_s == pytest.approx(two_nodes.dp_s / 10)


def test_pipeline_bubble_and_flops():
    assert bubble(Layout(pp=4), 4) == pytest.approx(3 / 7)
    assert bubble(Layout(pp=4, virtual_stages=2), 4) == pytest.approx(3 / 11)
    assert bubble(Layout(dp=8), 4) == 0.0
    model = _tiny()
    run = Workload(seq_length=32, micro_batch_size=4, global_batch_size=16)
    # The matmul FLOPs of the modules themselves (torch's counter, forward x 3 for backward)
    # with MLM logits at every position, which the 72 B s L h^2 formula counts.
    from torch.utils.flop_counter import FlopCounterMode

    from megabert.parallel.state import ParallelState
    from megabert.tasks.pretraining import BertForPreTraining

    net = BertForPreTraining(model, ParallelState.offline(), device="cpu")
    net.eval()
    ids = torch.randint(0, 512, (4, 32))
    with FlopCounterMode(display=False) as counter:
        net(ids, attention_mask=torch.ones_like(ids), token_type_ids=torch.zeros_like(ids))
    counted = 3 * counter.get_total_flops() * 4  # four micro-batches
    assert step_flops(model, run, Layout()) == pytest.approx(counted, rel=0.1)
    # Full recompute runs the forward twice; TP and PP divide the work; the bubble adds idle time.
    rate = 1e12
    base = compute_time(model, run, Layout(), rate)
    assert compute_time(model, Workload(seq_length=32, micro_batch_size=4, global_batch_size=16,
                                        recompute="full"), Layout(), rate) == pytest.approx(base * 4 / 3)
    assert compute_time(model, run, Layout(tp=2), rate) == pytest.approx(base / 2)
    assert compute_time(model, run, Layout(pp=2), rate) == pytest.approx(base / 2 / (1 - 1 / 5))


def test_plan_ranks_by_step_time_and_slow_links_move_work_off_them():
    model, run = bert_large(), Workload(micro_batch_size=32, global_batch_size=2048, precision="bf16")
    fast = plan(model, run, 16, 80, links=Links(gpus_per_node=8, intra_gbit=2400, inter_gbit=400),
                flops_per_s=150e12)
    slow = plan(model, run, 16, 80, links=Links(gpus_per_node=8, intra_gbit=2400, inter_gbit=10),
                flops_per_s=150e12)
    for fits in (fast, slow):
        totals = [c.step.total_s for c in fits]
        assert totals == sorted(totals)
    # 10 Gbit/s between nodes: a layout whose DP crosses them pays more than at 400.
    dp16 = {c.layout: c for c in slow}[Layout(dp=16)]
    assert dp16.step.total_s > {c.layout: c for c in fast}[Layout(dp=16)].step.total_s
    assert slow[0].step.total_s < dp16.step.total_s
    with pytest.raises(ConfigError, match="needs both the links and the FLOP rate"):
        plan(model, run, 16, 80, links=Links(gpus_per_node=8, intra_gbit=2400, inter_gbit=400))
    with pytest.raises(ConfigError, match="bandwidths must be positive"):
        Links(gpus_per_node=8, intra_gbit=0, inter_gbit=400)


def test_cli_step_time():
    r = run_main("tools/plan_layout.py", "--preset", "bert-large", "--devices", "16", "--memory-gb", "80",
                 "--global-batch-size", "2048", "--micro-batch-size", "32", "--bf16", "--tflops", "150", "--top", "3")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[3].startswith("step time: 150 TFLOP/s per device, 8 per node, 2400 / 200 Gbit/s")
    assert "step s" in lines[4] and "samples/s" in lines[4]
    steps = [float(line.split()[7]) for line in lines[5:8]]
    assert steps == sorted(steps)
    one = run_main("tools/plan_layout.py", "--preset", "bert-large", "--data-parallel-size", "16",
                   "--global-batch-size", "2048", "--micro-batch-size", "32", "--bf16", "--tflops", "150")
    assert "predicted step: " in one.stdout and "hidden by overlap" in one.stdout
    off = run_main("tools/plan_layout.py", "--preset", "bert-large", "--data-parallel-size", "16",
                   "--global-batch-size", "2048", "--micro-batch-size", "32", "--bf16", "--tflops", "150",
                   "--no-overlap-grad-reduce")
    step = lambda out: float(out.split("predicted step: ")[1].split(" s")[0])  # noqa: E731
    assert step(off.stdout) > step(one.stdout)
    bad = run_main("tools/plan_layout.py", "--preset", "bert-large", "--tflops", "0")
    assert bad.returncode == 2 and bad.stderr.startswith("error: --tflops must be positive")
