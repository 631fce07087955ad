"""A lost peer ends a rank within --distributed-timeout-minutes with one line that names the
group, the op and the peer: for every group megabert makes (world, TP forward and backward,
PP's p2p both ways, the model-parallel grad norm, DP's overlapped bucket, the ring's DP group,
the embedding group, DeepSpeed's traffic and a group DeepSpeed makes), two ranks of which
one stops for good after a first round that works; and a pretrain_bert.py run under torchrun
whose rank 1 stops mid-run, where rank 0 exits non-zero with that line and torchrun passes
the failure on.

"Stops" is SIGSTOP: the stopped rank's sockets stay open, as behind a cut link or on a hung
host, so nothing but the group's timeout can end the wait (a rank that exits closes its
sockets and its peers fail at once: one case here shows that line too). Before issue 39
every group but the world waited torch's default, 30 minutes on gloo.

Cheap: the pairs fork from one forkserver that imported torch, megabert and DeepSpeed once,
and they all wait at the same time, so the file waits about one timeout, not one per group.
"""
import multiprocessing
import os
import re
import signal
import socket
import subprocess
import time
import traceback

import psutil
import pytest
import torch

from tests.helpers.pretrain_runs import TORCHRUN, one_line_error, pretrain_args, run_main

TIMEOUT_MIN = 0.08  # 4.8 s: --distributed-timeout-minutes of every run here
HANG_S = 90.0  # a survivor that has not answered by then hangs: the test fails instead of waiting on


# ------------------------------------------------------------------ the cases
# Each takes the rank's ParallelState, runs one round that works on both ranks, and returns
# the op that the surviving rank then runs alone.

def _world(ps):
    from megabert.parallel import comm

    comm.all_reduce(torch.ones(4))
    return lambda: comm.all_reduce(torch.ones(4))


def _tp_forward(ps):
    from megabert.tensor_parallel.layers import RowParallelLinear

    layer = RowParallelLinear(8, 4, tp_group=ps.tp_group)
    layer(torch.ones(2, 4))
    return lambda: layer(torch.ones(2, 4))


def _tp_backward(ps):
    from megabert.tensor_parallel.layers import ColumnParallelLinear

    layer = ColumnParallelLinear(4, 8, tp_group=ps.tp_group)

    def step():  # the input's gradient is summed over TP in backward (autograd's thread raises it)
        x = torch.ones(2, 4, requires_grad=True)
        layer(x).sum().backward()

    step()
    return step


def _pp_recv(ps):
    from megabert.pipeline_parallel.p2p import PipeComm

    pipe = PipeComm(ps, (2, 1, 4), torch.float32)
    if ps.is_first_stage:
        pipe.send_forward(torch.ones(2, 1, 4), tag=0)
        pipe.wait_sends()
    else:
        pipe.recv_forward(tag=0)
    return lambda: pipe.recv_forward(tag=1)  # the last stage waits for the first, which stopped


def _pp_backward_recv(ps):
    from megabert.pipeline_parallel.p2p import PipeComm

    pipe = PipeComm(ps, (2, 1, 4), torch.float32)
    if ps.is_last_stage:
        pipe.send_backward(torch.ones(2, 1, 4), tag=0)
        pipe.wait_sends()
    else:
        pipe.recv_backward(tag=0)
    return lambda: pipe.recv_backward(tag=1)  # the first stage waits for the last's gradient


def _mp_norm(ps):
    from megabert.parallel.param_spec import describe
    from megabert.training.grads import grad_norm

    split = describe(torch.nn.Parameter(torch.ones(4)), partition_dim=0)
    split.grad = torch.ones(4)
    grad_norm([split], ps)  # summed over the model-parallel group (TP x PP)
    return lambda: grad_norm([split], ps)


def _dp_bucket(ps):
    from megabert.data_parallel.overlap import OverlappedGradReducer

    model = torch.nn.Linear(4, 4)
    reducer = OverlappedGradReducer(list(model.parameters()), ps, bucket_elements=8)

    def step():  # backward issues the buckets; finish() waits for them
        reducer.start(1)
        model(torch.ones(2, 4)).sum().backward()
        reducer.finish()

    step()
    return step


def _dp_ring(ps):
    from megabert.data_parallel.ring import RingCommunicator

    ring = RingCommunicator(ps.new_dp_group(), 64, device=torch.device("cpu"))
    ring.reduce_scatter(torch.ones(16)).wait()
    return lambda: ring.reduce_scatter(torch.ones(16)).wait()


def _embedding(ps):
    from megabert.parallel.param_spec import describe
    from megabert.training.grads import sync_tied_embedding_grads

    tied = describe(torch.nn.Parameter(torch.ones(4)), placement="tied")
    tied.grad = torch.ones(4)
    sync_tied_embedding_grads([tied], ps)
    return lambda: sync_tied_embedding_grads([tied], ps)


def _deepspeed_dp(ps):
    """What ZeRO sends: deepspeed.comm over our DP group (handed over as mpu)."""
    import deepspeed.comm as ds

    from megabert.training.deepspeed.engine import start_comm

    start_comm(ps)
    ds.reduce_scatter_tensor(torch.zeros(2), torch.ones(4), group=ps.dp_group)
    return lambda: ds.reduce_scatter_tensor(torch.zeros(2), torch.ones(4), group=ps.dp_group)


def _deepspeed_own(ps):
    """A group DeepSpeed creates itself (MoE, ZeRO++ do): the run's timeout all the same."""
    import deepspeed.comm as ds

    from megabert.training.deepspeed.engine import start_comm

    start_comm(ps)
    group = ds.new_group([0, 1])
    ds.all_reduce(torch.ones(4), group=group)
    return lambda: ds.all_reduce(torch.ones(4), group=group)


# name -> (tp, pp, the rank that stops or exits, how, set-up, the op and group the line names)
CASES = {
    "world": (1, 1, 1, "stop", _world, "all_reduce on the world group (ranks 0, 1)"),
    "tp_forward": (2, 1, 1, "stop", _tp_forward, "all_reduce on the tensor-parallel group (ranks 0, 1)"),
    "tp_backward": (2, 1, 1, "stop", _tp_backward, "all_reduce on the tensor-parallel group (ranks 0, 1)"),
    "pp_p2p": (1, 2, 0, "stop", _pp_recv, "recv on the pipeline group (ranks 0, 1)"),
    "pp_backward_p2p": (1, 2, 1, "stop", _pp_backward_recv, "recv on the pipeline's backward group (ranks 0, 1)"),
    "mp_grad_norm": (2, 1, 1, "stop", _mp_norm, "all_reduce on the model-parallel group (ranks 0, 1)"),
    "dp_bucket": (1, 1, 1, "stop", _dp_bucket, "all_reduce on the data-parallel group (ranks 0, 1)"),
    "dp_ring": (1, 1, 1, "stop", _dp_ring, "ring reduce_scatter's send on the data-parallel ring's group (ranks 0, 1)"),
    "embedding": (1, 2, 1, "stop", _embedding, "all_reduce on the embedding group (ranks 0, 1)"),
    "deepspeed_dp": (1, 1, 1, "stop", _deepspeed_dp, "reduce_scatter_tensor on the data-parallel group (ranks 0, 1)"),
    "deepspeed_own": (1, 1, 1, "stop", _deepspeed_own, "all_reduce on the deepspeed group (ranks 0, 1)"),
    "dp_bucket_exited": (1, 1, 1, "exit", _dp_bucket, "all_reduce on the data-parallel group (ranks 0, 1)"),
}


# ------------------------------------------------------------------ the pairs

def _rank_main(name: str, rank: int, port: int, results) -> None:
    tp, pp, victim, how, setup, _ = CASES[name]
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import megabert
    from megabert.errors import CommunicationError

    try:
        ps = megabert.init_parallel(tp, pp, backend="gloo", timeout_minutes=TIMEOUT_MIN)
        op = setup(ps)
    except BaseException:  # noqa: B902  (the set-up must work on both ranks: report, do not hang the pair)
        results.put((name, rank, "setup", traceback.format_exc(), 0.0))
        os._exit(1)
    if rank == victim:
        results.put((name, rank, "victim", "", 0.0))
        if how == "exit":
            os._exit(0)
        os.kill(os.getpid(), signal.SIGSTOP)  # for good: the parent kills it
        os._exit(0)
    start = time.monotonic()
    try:
        op()
        outcome, text = "returned", "the op finished without its peer"
    except CommunicationError as e:
        outcome, text = "CommunicationError", str(e)
    except BaseException:  # noqa: B902
        outcome, text = "other", traceback.format_exc()
    results.put((name, rank, outcome, text, time.monotonic() - start))
    os._exit(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def outcomes():
    """{case: (outcome, the survivor's line, seconds from its op to the error)}, every
    pair run at once."""
    ctx = multiprocessing.get_context("forkserver")
    preload = ["torch", "torch.distributed", "megabert", "megabert.data_parallel.overlap", "megabert.data_parallel.ring",
               "megabert.pipeline_parallel.p2p", "megabert.tensor_parallel.layers", "megabert.training.grads",
               "deepspeed.comm", "megabert.training.deepspeed.engine", __name__]
    ctx.set_forkserver_preload(preload)
    results = ctx.SimpleQueue()  # writes at put(): a rank leaves by os._exit right after
    procs = {}
    for name in CASES:
        port = _free_port()
        for rank in (0, 1):
            procs[name, rank] = ctx.Process(target=_rank_main, args=(name, rank, port, results), daemon=True)
            procs[name, rank].start()
    out, deadline = {}, time.monotonic() + HANG_S
    try:
        while len(out) < len(CASES) and time.monotonic() < deadline:
            if not results._reader.poll(1.0):
                continue
            name, rank, outcome, text, seconds = results.get()
            if outcome != "victim":
                out[name] = (outcome, text, seconds)
    finally:
        for p in procs.values():
            if p.is_alive():
                p.kill()  # stopped victims, and survivors that hang
            p.join()
    for name in CASES:
        out.setdefault(name, ("hang", f"no answer within {HANG_S:.0f} s", HANG_S))
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_the_survivor_ends_with_one_line_naming_group_op_and_peer(outcomes, case):
    _, _, victim, how, _, where = CASES[case]
    outcome, line, seconds = outcomes[case]
    assert outcome == "CommunicationError", line
    assert "\n" not in line
    if how == "stop":  # the group waited the run's timeout, not torch's 30 minutes
        expected = (f"{where}: no word from rank {victim} for 4.8 s (--distributed-timeout-minutes 0.08): it stopped "
                    f"or the link to it dropped; see its log and its host [")
    else:
        expected = f"{where}: rank {victim} closed the connection: it exited or was killed; its own log says why ["
    assert line.startswith(expected), line
    print(f"{case}: {seconds:.2f} s: {line}")


def test_only_a_lost_peer_is_reworded():
    """A backend's words for a lost peer become one line without gloo's source path and its
    advice; an error of the caller's arguments passes through as it was raised."""
    from megabert.errors import CommunicationError
    from megabert.parallel.failures import translate

    bug = RuntimeError("Tensors must be contiguous")
    assert translate(bug, None, "all_reduce") is bug
    closed = RuntimeError("[/src/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                          "[10.0.0.2]:41614. This is typically caused by a remote worker crashing. Check the logs "
                          "of the remote worker before reporting an error. GLHF!")
    out = translate(closed, None, "recv", peer=3)
    assert isinstance(out, CommunicationError) and out.__cause__ is closed
    assert str(out).endswith(": rank 3 closed the connection: it exited or was killed; its own log says why "
                             "[Connection closed by peer [10.0.0.2]:41614]"), str(out)


def test_a_rank_that_never_comes_ends_the_rendezvous_with_one_line(dataset, tmp_path, monkeypatch):
    port = _free_port()
    for name, value in dict(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                            MASTER_PORT=str(port)).items():
        monkeypatch.setenv(name, value)
    r = run_main(*pretrain_args(dataset, tmp_path / "m.jsonl", "--distributed-timeout-minutes", str(TIMEOUT_MIN)))
    one_line_error(r, f"error: rendezvous at 127.0.0.1:{port} failed within --distributed-timeout-minutes 0.08: "
                      f"start every rank, with the same MASTER_ADDR/MASTER_PORT, reachable from every node [")
    assert "1/2 clients joined" in r.stderr


# ------------------------------------------------------------------ end to end

def _stop_rank_1_mid_run(proc, metrics, deadline=240.0):
    """Waits for iteration 2 in the metrics file, then SIGSTOPs rank 1; (rank 0's process,
    rank 1's, the time)."""
    end = time.monotonic() + deadline
    while time.monotonic() < end and proc.poll() is None:
        if os.path.isfile(metrics) and sum(1 for _ in open(metrics)) >= 2:
            workers = {int(c.environ().get("RANK", -1)): c for c in psutil.Process(proc.pid).children(recursive=True)
                       if "pretrain_bert.py" in " ".join(c.cmdline())}
            if 0 in workers and 1 in workers:
                workers[1].send_signal(signal.SIGSTOP)
                return workers[0], workers[1], time.monotonic()
        time.sleep(0.02)
    pytest.fail("the run ended (or timed out) before rank 1 could be stopped")


@pytest.mark.slow
def test_pretrain_under_torchrun_ends_when_a_rank_stops(dataset, tmp_path):
    metrics, logs = tmp_path / "m.jsonl", tmp_path / "logs"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # --redirects 2: each rank's stderr in a file of its own, so rank 0's is read alone.
    cmd = [*TORCHRUN, "--standalone", "--nproc-per-node", "2", "--redirects", "2", "--log-dir", str(logs),
           *pretrain_args(dataset, metrics, "--train-iters", "100000", "--eval-interval", "0",
                          "--distributed-timeout-minutes", str(TIMEOUT_MIN))]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        survivor, stopped, stopped_at = _stop_rank_1_mid_run(proc, str(metrics))
        try:
            survivor.wait(timeout=HANG_S)
        except psutil.TimeoutExpired:
            pytest.fail(f"rank 0 still runs {HANG_S:.0f} s after rank 1 stopped")
        survivor_s = time.monotonic() - stopped_at
        # The agent would SIGTERM the stopped rank and SIGKILL it 30 s later; a stopped host
        # is gone anyway.
        stopped.kill()
        _, err = proc.communicate(timeout=HANG_S)
    finally:  # a failed test leaves no torchrun agent or worker behind
        if proc.poll() is None:
            for p in psutil.Process(proc.pid).children(recursive=True) + [psutil.Process(proc.pid)]:
                p.kill()
    assert proc.returncode != 0  # torchrun passes the failure on
    [rank0_err] = logs.glob("*/attempt_0/0/stderr.log")
    text = rank0_err.read_text()
    assert "Traceback" not in text, text[-3000:]
    last = text.strip().splitlines()[-1]
    assert re.fullmatch(r"error: \w+ on the (world|data-parallel) group \(ranks 0, 1\): no word from rank 1 "
                        r"for 4.8 s \(--distributed-timeout-minutes 0.08\): .*", last), last
    print(f"rank 0 exited {survivor_s:.2f} s after rank 1 stopped: {last}")
