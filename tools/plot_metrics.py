"""Draw loss, learning rate and throughput from --metrics-file JSONL as one PNG.

    plot_metrics.py run.jsonl --output curves.png
    plot_metrics.py tp1.jsonl tp2.jsonl --labels TP=1 TP=2 --output compare.png

Several files overlay their curves: the way to compare parallel layouts of one run.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from megabert.errors import DataError, cli_main

PANELS = [("loss", ("lm_loss", "sop_loss", "nsp_loss", "valid_lm_loss")), ("learning rate", ("lr",)),
          ("samples / s", ("samples_per_sec",))]


def read_jsonl(path: str) -> list[dict]:
    rows = []
    try:
        with open(path) as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError:
                        raise DataError(f"{path}:{n} is not a JSON line")
    except OSError as e:
        raise DataError(f"cannot read {path}: {e.strerror}")
    if not rows:
        raise DataError(f"{path} holds no metrics")
    return rows


def plot(files: list[str], labels: list[str], output: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display on a training node
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(PANELS), figsize=(5 * len(PANELS), 4))
    for path, label in zip(files, labels):
        rows = read_jsonl(path)
        for ax, (title, keys) in zip(axes, PANELS):
            for key in keys:
                pts = [(r["iteration"], r[key]) for r in rows if key in r]
                if pts:
                    xs, ys = zip(*pts)
                    ax.plot(xs, ys, marker="." if len(pts) < 50 else None,
                            label=f"{label} {key}" if len(files) > 1 or len(keys) > 1 else label)
            ax.set_title(title)
            ax.set_xlabel("iteration")
    for ax in axes:
        if ax.lines:
            ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    fig.savefig(output, dpi=100)


@cli_main
def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+", help="--metrics-file JSONL files")
    p.add_argument("--labels", nargs="+", help="one label per file (default: file names)")
    p.add_argument("--output", default="metrics.png")
    args = p.parse_args(argv)
    labels = args.labels or [os.path.splitext(os.path.basename(f))[0] for f in args.files]
    if len(labels) != len(args.files):
        raise DataError(f"--labels has {len(labels)} entries for {len(args.files)} files")
    plot(args.files, labels, args.output)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    sys.exit(main())
