"""Prints megabert's requirements from pyproject.toml, one per line: the dependencies and
those of the extras named, megabert itself left out.

`make install` feeds them to one pip while another pip builds megabert's C++ extensions
(`pip install --no-deps -e .`): the build keeps both cores busy for about a minute, the
dependencies' install mostly one (downloading, unpacking), so side by side they take about
the build's time instead of the sum.

    python tools/requirements.py deepspeed,mpi,test > requirements.txt
    python tools/requirements.py --against-torch deepspeed,mpi,test > requirements-torch.txt

Two lists, because only what must compile against the venv's torch may be built without
build isolation (`--against-torch`: DeepSpeed, whose sdist imports torch at build time).
Everything else builds in pip's isolated env with a current setuptools: an sdist built
without isolation sees whatever setuptools the venv has, and seqeval 1.2.2's setup.py
under setuptools 84 reports version 0.0.0, so pip discards it ("No matching distribution
found for seqeval>=1.2") on a machine whose package cache holds no seqeval wheel yet.

Needs Python 3.11+ (tomllib); exits 1 with one line on an older Python, and `make install`
then installs the dependencies and builds one after the other.
"""
from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Distributions whose build imports torch: built with --no-build-isolation against the
# venv's torch (an isolated build env would fetch a multi-GB torch of its own).
BUILT_AGAINST_TORCH = ("deepspeed",)


def _name(req: str) -> str:
    """The distribution name of a requirement line ("deepspeed>=0.19,<0.20" -> "deepspeed")."""
    for i, ch in enumerate(req):
        if not (ch.isalnum() or ch in "-_."):
            return req[:i].strip().lower().replace("_", "-")
    return req.strip().lower().replace("_", "-")


def requirements(project: dict, extras: list[str]) -> list[str]:
    """The project's dependencies, then each named extra's, in file order, without repeats."""
    optional = project.get("optional-dependencies", {})
    unknown = [e for e in extras if e not in optional]
    if unknown:
        raise SystemExit(f"error: no extra {', '.join(unknown)} in pyproject.toml (it has {', '.join(optional)})")
    out: list[str] = []
    for req in project.get("dependencies", []) + [r for e in extras for r in optional[e]]:
        if req not in out:
            out.append(req)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("extras", nargs="?", default="", help="comma-separated extras, e.g. deepspeed,mpi,test")
    p.add_argument("--against-torch", action="store_true",
                   help="print only the requirements that build against the venv's torch (no build isolation); "
                        "without it, every other requirement")
    args = p.parse_args(argv)
    try:
        import tomllib
    except ImportError:
        sys.stderr.write(f"requirements.py: Python {sys.version.split()[0]} has no tomllib (3.11+)\n")
        return 1
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    reqs = requirements(project, [e for e in args.extras.split(",") if e])
    print("\n".join(r for r in reqs if (_name(r) in BUILT_AGAINST_TORCH) == args.against_torch))
    return 0


if __name__ == "__main__":
    sys.exit(main())
