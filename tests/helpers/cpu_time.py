"""A pytest plugin that writes each test's CPU seconds (the test process, its waited-for
children and its live descendants: torchrun workers, the warm pool's workers) and wall
seconds as JSON lines, to find what the suite's time is spent on (issue 28). Not loaded by
default:

    .venv/bin/python -m pytest -n 2 --dist loadfile -p tests.helpers.cpu_time tests
    # CPU_TIME_LOG (default cpu_time.jsonl) receives {"test", "cpu", "wall"} per test

On a 2-core machine the suite is CPU-bound, so CPU seconds, unlike durations under xdist,
add up to the wall time it needs and do not depend on what ran beside each test.
"""
import json
import os
import resource
import time

import pytest

_TICK = os.sysconf("SC_CLK_TCK")


def _live_descendants_cpu(root: int) -> float:
    children: dict[int, list[tuple[int, float]]] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
        except OSError:  # gone meanwhile
            continue
        children.setdefault(int(fields[1]), []).append((int(pid), (int(fields[11]) + int(fields[12])) / _TICK))
    total, stack = 0.0, [root]
    while stack:
        for pid, cpu in children.get(stack.pop(), []):
            total += cpu
            stack.append(pid)
    return total


def _cpu() -> float:
    own, done = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + done.ru_utime + done.ru_stime + _live_descendants_cpu(os.getpid())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    cpu, wall = _cpu(), time.time()
    yield
    row = {"test": item.nodeid, "cpu": round(_cpu() - cpu, 2), "wall": round(time.time() - wall, 2)}
    with open(os.environ.get("CPU_TIME_LOG", "cpu_time.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\n")
