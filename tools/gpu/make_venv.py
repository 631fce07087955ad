"""Creates `make install`'s venv, reusing the creating python's torch when it has CUDA.

A GPU image ships a CUDA torch matched to its driver (and no registry to fetch another):
the venv must see that torch, never replace it. So when the python that runs this imports
a CUDA torch, the venv is made with --system-site-packages; when that python is itself a
venv (as on images whose python3 is /opt/torch/.venv/bin/python3), --system-site-packages
would expose only the *base* interpreter's packages, so a .pth file adds the parent venv's
site-packages too. Otherwise (a CPU machine) the venv is a plain one, as before, and
`make install` puts torch==2.13.0 into it.

    python3 tools/gpu/make_venv.py .venv
"""
from __future__ import annotations

import importlib.util
import os
import site
import subprocess
import sys
import sysconfig
import venv
from dataclasses import dataclass
from typing import Optional

PTH_NAME = "megabert-parent-site.pth"


@dataclass(frozen=True)
class VenvPlan:
    """system_site: --system-site-packages; parent_site: folders a .pth file adds (the
    creating venv's site-packages); with_pip: install pip with ensurepip; reason: one line."""

    system_site: bool
    parent_site: tuple[str, ...]
    with_pip: bool
    reason: str


def plan_venv(torch_version: Optional[str], torch_cuda: Optional[str], in_venv: bool,
              site_dirs: tuple[str, ...], has_ensurepip: bool) -> VenvPlan:
    """The decision, from the creating python's torch (None when it has none), whether that
    python runs inside a venv, its site-packages folders and whether ensurepip exists."""
    if not torch_cuda:
        why = f"torch {torch_version} has no CUDA" if torch_version else "no torch"
        return VenvPlan(False, (), True, f"a plain venv ({why} in {sys.executable}; make install adds one)")
    parent = site_dirs if in_venv else ()
    # Without ensurepip (some distributions split it off) the system's own pip, visible
    # through the shared site-packages, installs into the venv just as well.
    return VenvPlan(True, parent, has_ensurepip,
                    f"reusing torch {torch_version} (CUDA {torch_cuda}) of {sys.executable} "
                    f"(--system-site-packages{', its venv site-packages through a .pth' if parent else ''})")


def _torch() -> tuple[Optional[str], Optional[str]]:
    try:
        import torch
    except Exception:  # noqa: BLE001 - a broken torch counts as none: the venv gets its own
        return None, None
    return torch.__version__, torch.version.cuda


def create(path: str, plan: VenvPlan) -> None:
    # symlinks as `python -m venv` makes them on POSIX (EnvBuilder's own default copies).
    venv.EnvBuilder(system_site_packages=plan.system_site, with_pip=plan.with_pip,
                    symlinks=os.name != "nt").create(path)
    if plan.parent_site:
        vpy = os.path.join(path, "bin", "python")
        purelib = subprocess.run([vpy, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                 capture_output=True, text=True, check=True).stdout.strip()
        with open(os.path.join(purelib, PTH_NAME), "w") as f:
            f.write("\n".join(plan.parent_site) + "\n")


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit("usage: python3 tools/gpu/make_venv.py VENV_DIR")
    version, cuda = _torch()
    in_venv = sys.prefix != sys.base_prefix
    site_dirs = tuple(dict.fromkeys(p for p in site.getsitepackages() + [sysconfig.get_paths()["purelib"]]
                                    if os.path.isdir(p)))
    plan = plan_venv(version, cuda, in_venv, site_dirs, importlib.util.find_spec("ensurepip") is not None)
    print(f"make_venv: {sys.argv[1]}: {plan.reason}")
    create(sys.argv[1], plan)


if __name__ == "__main__":
    main()
