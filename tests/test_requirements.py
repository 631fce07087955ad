"""tools/requirements.py splits megabert's dependencies for `make install`: only what compiles
against the venv's torch builds without build isolation (an sdist built that way sees the
venv's setuptools: seqeval 1.2.2 then calls itself 0.0.0 and pip finds no seqeval>=1.2)."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "tools", "requirements.py")


def _lines(*args):
    out = subprocess.run([sys.executable, TOOL, *args], capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if line]


def test_only_deepspeed_builds_against_the_venvs_torch():
    isolated = _lines("deepspeed,mpi,test")
    against_torch = _lines("--against-torch", "deepspeed,mpi,test")
    assert [r.split(">")[0].split("=")[0] for r in against_torch] == ["deepspeed"]
    assert any(r.startswith("seqeval") for r in isolated)
    assert not set(isolated) & set(against_torch)
    everything = _lines("deepspeed,mpi,test") + _lines("--against-torch", "deepspeed,mpi,test")
    assert len(everything) == len(set(everything)) and any(r.startswith("torch") for r in everything)


def test_without_the_deepspeed_extra_nothing_builds_against_torch():
    assert _lines("--against-torch", "test") == []


def test_an_unknown_extra_is_one_line():
    p = subprocess.run([sys.executable, TOOL, "nosuch"], capture_output=True, text=True)
    assert p.returncode != 0 and p.stderr.strip().count("\n") == 0 and "no extra nosuch" in p.stderr
