"""Interleaved timing shared by the benches: every side steps once per round, in an order
that rotates, so that a noisy machine slows all sides alike; each side's figure is its
median step time."""
from __future__ import annotations

import statistics
import time
from typing import Callable


def interleaved(steps: dict[str, Callable[[], object]], rounds: int, warmup: int = 2) -> dict[str, float]:
    """{side: median seconds per step} over `rounds` interleaved rounds."""
    for step in steps.values():  # allocator, lazy init, first kernel choice
        for _ in range(warmup):
            step()
    times = {name: [] for name in steps}
    for r in range(rounds):
        names = list(steps)
        for name in names[r % len(names):] + names[:r % len(names)]:
            t0 = time.perf_counter()
            steps[name]()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def print_table(medians: dict[str, float], labels: dict[str, str], tokens_per_step: int, peer: str) -> None:
    """One row per side: ms per step, tokens/s and the ratio to `peer`."""
    print(f"{'side':18} {'backends':20} {'step ms':>9} {'tokens/s':>10} {'vs ' + peer:>16}")
    for name, t in medians.items():
        print(f"{name:18} {labels.get(name, ''):20} {t * 1e3:9.1f} {tokens_per_step / t:10.0f} "
              f"{medians[peer] / t:15.2f}x")


def compare(sides: dict[str, tuple[Callable[[], object], str]], rounds: int, tokens_per_step: int, header: str,
            peer: str = "transformers") -> None:
    """Times {side: (step, backends label)} interleaved, then prints `header` and the table."""
    medians = interleaved({name: step for name, (step, _) in sides.items()}, rounds)
    print(header)
    print_table(medians, {name: label for name, (_, label) in sides.items()}, tokens_per_step, peer)
