"""A save that cannot write (a full disk, a permission, a read-only file system) is one
line on every rank, not a traceback: it names --save, the iteration, the cause and the
newest complete checkpoint, which stays intact and resumes bitwise; the failed save's
staging directory is removed. A stub of a full disk (in process, and on one rank of two)
and, where this runs as root, a real tmpfs with room for one and a half checkpoints."""
import builtins
import errno
import os
import shutil
import subprocess
import sys

import pytest

import megabert
from megabert.checkpoint import layout
from megabert.errors import CheckpointError
from tests.helpers.cli_utils import ROOT, run_main
from tests.helpers.dist_utils import run_distributed
from tests.helpers.pretrain_runs import pretrain_args, rows, run_cmd
from tests.helpers.train_utils import build_trainer


class FullDisk:
    """Stands in for `open` in megabert.checkpoint.layout, where checkpoint bytes are
    written: a file system with room for one and a half checkpoints (the first rank file
    written through it sets the size). Once the room is used up, a write stores what fits
    and fails as a full disk's does (OSError ENOSPC)."""

    def __init__(self):
        self.room = None

    def open(self, path, mode="r", *args, **kwargs):
        f = builtins.open(path, mode, *args, **kwargs)
        return f if "r" in mode else _Limited(f, self, path.endswith(".part"))

    def take(self, n: int) -> int:
        """How many of n bytes fit."""
        if self.room is None:
            return n
        fit = min(n, self.room)
        self.room -= fit
        return fit


class _Limited:
    def __init__(self, f, disk: FullDisk, rank_file: bool):
        self.f, self.disk, self.rank_file, self.written = f, disk, rank_file, 0

    def write(self, data):
        data = data if isinstance(data, str) else memoryview(data).cast("B")
        fit = self.disk.take(len(data))
        self.f.write(data[:fit])
        self.written += fit
        if fit < len(data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return fit

    def close(self):
        if self.rank_file and self.disk.room is None:  # the first checkpoint: half of one more fits
            self.disk.room = self.written // 2
        self.f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __getattr__(self, name):
        return getattr(self.f, name)


def _pretrain(d, metrics, ck, *extra, iters=4):
    """pretrain_bert.py's flags (after the script), saving every 2 of `iters` iterations to `ck`."""
    return pretrain_args(d, metrics, "--train-iters", str(iters), "--save", str(ck), "--save-interval", "2",
                         *extra)[1:]


def _losses(metrics) -> dict:
    return {r["iteration"]: r["lm_loss"] for r in rows(metrics) if "lm_loss" in r}


def _newest_named(ck) -> str:
    return f"the newest complete checkpoint, {ck}/iter_0000002 (iteration 2), is intact"


def test_full_disk_is_one_line_and_the_first_checkpoint_resumes_bitwise(dataset, tmp_path, monkeypatch):
    ref = run_main("pretrain_bert.py", *_pretrain(dataset, tmp_path / "ref.jsonl", tmp_path / "ref"))
    assert ref.returncode == 0, ref.stderr[-3000:]
    megabert.destroy_parallel()
    ck = tmp_path / "ck"
    with monkeypatch.context() as m:
        m.setattr(layout, "open", FullDisk().open, raising=False)  # the module's `open` shadows the builtin
        full = run_main("pretrain_bert.py", *_pretrain(dataset, tmp_path / "full.jsonl", ck))
    megabert.destroy_parallel()
    assert full.returncode == 2 and "Traceback" not in full.stderr, full.stderr[-3000:]
    errors = [line for line in full.stderr.splitlines() if line.startswith("error")]
    assert errors == [f"error: cannot save iteration 4 to --save {ck}: [Errno 28] No space left on device; "
                      f"{_newest_named(ck)}: make room (or fix the permissions, or point --save elsewhere) and "
                      f"resume it with --load {ck}"]
    assert sorted(os.listdir(ck)) == ["iter_0000002", "latest_checkpointed_iteration.txt"]  # no iter_0000004.tmp
    again = run_main("pretrain_bert.py", *_pretrain(dataset, tmp_path / "full.jsonl", ck, "--load", str(ck)))
    assert again.returncode == 0, again.stderr[-3000:]
    assert _losses(tmp_path / "full.jsonl") == _losses(tmp_path / "ref.jsonl")  # 1-2 before, 3-4 resumed: bitwise


def _full_disk_on_rank_1(rank, world, ck):
    disk = FullDisk()
    if rank == 1:
        layout.open = disk.open
    try:
        _, _, trainer = build_trainer(["--save", ck, "--save-interval", "2", "--train-iters", "4"], tp=2)
        try:
            with pytest.raises(CheckpointError) as failed:
                trainer.train()
        finally:
            trainer.close()
    finally:
        if rank == 1:
            del layout.open
    # Rank 0 wrote its part of iteration 4; rank 1 could not: neither commits, both say why.
    assert str(failed.value).startswith(f"cannot save iteration 4 to --save {ck}: [Errno 28] No space left on device "
                                        f"(rank 1); {_newest_named(ck)}")
    assert sorted(os.listdir(ck)) == ["iter_0000002", "latest_checkpointed_iteration.txt"]
    _, _, trainer = build_trainer(["--save", ck, "--load", ck, "--save-interval", "2", "--train-iters", "4"], tp=2)
    try:
        assert trainer.state.iteration == 2
        trainer.train()
    finally:
        trainer.close()
    assert open(os.path.join(ck, "latest_checkpointed_iteration.txt")).read() == "4"


def test_a_rank_that_cannot_write_fails_the_save_on_every_rank(tmp_path):
    run_distributed(_full_disk_on_rank_1, 2, str(tmp_path / "ck"))


def test_any_os_error_while_saving_is_one_line(tmp_path, monkeypatch):
    """Not only a full disk: a rank file the save may not create (a permission, a read-only
    file system) stops the first save alike, and nothing of it is left."""
    def denied(path, mode="r", *args, **kwargs):
        if "r" in mode:
            return builtins.open(path, mode, *args, **kwargs)
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)

    monkeypatch.setattr(layout, "open", denied, raising=False)
    ck = tmp_path / "ck"
    _, _, trainer = build_trainer(["--save", str(ck), "--save-interval", "2", "--train-iters", "2"])
    try:
        with pytest.raises(CheckpointError) as failed:
            trainer.train()
    finally:
        trainer.close()
    part = ck / "iter_0000002.tmp" / "mp_rank_00" / "model_optim_rng.pt.part"
    assert str(failed.value) == (f"cannot save iteration 2 to --save {ck}: [Errno 13] Permission denied: '{part}'; "
                                 f"{ck} holds no complete checkpoint yet: make room (or fix its permissions, or point "
                                 f"--save elsewhere) and start again")
    assert os.listdir(ck) == []


@pytest.fixture
def small_tmpfs(tmp_path):
    """mount(size) -> a tmpfs of `size` bytes, unmounted afterwards; skips where mounting is
    not allowed (not root, or a container without the capability)."""
    mounted = []

    def mount(size: int):
        d = tmp_path / "disk"
        d.mkdir()
        if os.geteuid() != 0 or shutil.which("mount") is None:
            pytest.skip("mounting a tmpfs needs root")
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(d)], capture_output=True,
                           text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
        mounted.append(d)
        return d

    yield mount
    for d in mounted:
        subprocess.run(["umount", str(d)], check=True)


def test_a_real_full_tmpfs_is_one_line(dataset, tmp_path, small_tmpfs):
    """As a user meets it: pretrain_bert.py --save on a file system with room for one and a
    half checkpoints."""
    ref = run_main("pretrain_bert.py", *_pretrain(dataset, tmp_path / "ref.jsonl", tmp_path / "ref", iters=2))
    assert ref.returncode == 0, ref.stderr[-3000:]
    size = os.path.getsize(tmp_path / "ref" / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt")
    ck = small_tmpfs(size * 3 // 2) / "ck"
    r = run_cmd([sys.executable, os.path.join(ROOT, "pretrain_bert.py"), *_pretrain(dataset, tmp_path / "m.jsonl", ck)])
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    errors = [line for line in r.stderr.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and errors[0].startswith(f"error: cannot save iteration 4 to --save {ck}: [Errno 28] "
                                                     f"No space left on device; {_newest_named(ck)}"), r.stderr
    assert sorted(os.listdir(ck)) == ["iter_0000002", "latest_checkpointed_iteration.txt"]
