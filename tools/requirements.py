"""Prints megabert's requirements from pyproject.toml, one per line: the dependencies and
those of the extras named, megabert itself left out.

`make install` feeds them to one pip while another pip builds megabert's C++ extensions
(`pip install --no-deps -e .`): the build keeps both cores busy for about a minute, the
dependencies' install mostly one (downloading, unpacking), so side by side they take about
the build's time instead of the sum.

    python tools/requirements.py deepspeed,mpi,test > requirements.txt

Needs Python 3.11+ (tomllib); exits 1 with one line on an older Python, and `make install`
then installs the dependencies and builds one after the other.
"""
from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
    args = p.parse_args(argv)
    try:
        import tomllib
    except ImportError:
        sys.stderr.write(f"requirements.py: Python {sys.version.split()[0]} has no tomllib (3.11+)\n")
        return 1
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    print("\n".join(requirements(project, [e for e in args.extras.split(",") if e])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
