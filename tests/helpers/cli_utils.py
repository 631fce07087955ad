"""Runs an entry script's main() in this process, the way its command line would, for
tests of flag and file errors: the same parser, rules and `cli_main` wrapper, without a
new interpreter's start-up (about 2 s each). One subprocess per script still checks the
real command line (tests/test_config.py), and one torchrun launch per script the launcher.
`main_worker` runs main() on the ranks of dist_utils' warm worker pool: for tests that
compare layouts, where a torchrun launch per layout would cost 5-10 s of start-up."""
from __future__ import annotations

import contextlib
import importlib.util
import io
import logging
import os
from types import SimpleNamespace

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo
_modules: dict[str, object] = {}


def _entry(script: str):
    if script not in _modules:
        spec = importlib.util.spec_from_file_location(script.removesuffix(".py").replace("/", "_"),
                                                      os.path.join(ROOT, script))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _modules[script] = module
    return _modules[script]


def run_main(script: str, *argv: str) -> SimpleNamespace:
    """(returncode, stdout, stderr) of `python script argv...`, run in process."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = _entry(script).main(list(argv))
        except SystemExit as e:  # argparse's own exits (--help, a parse error)
            rc = e.code if isinstance(e.code, int) else 1
    rc = 0 if rc is None else rc  # as sys.exit(main()) turns it (tests/test_config.py checks that wiring)
    return SimpleNamespace(returncode=rc, stdout=out.getvalue(), stderr=err.getvalue())


def main_worker(rank: int, world_size: int, script: str, argv: list[str], log_file: str | None = None) -> None:
    """A body for dist_utils.run_distributed: `script`'s main(argv) on this rank, in the
    pool's process group (init_parallel takes a group that already exists, as it takes
    torchrun's), everything else as `torchrun script argv...` runs it. With `log_file`,
    rank 0 also writes what megabert logs there, one `LEVEL message` line per record (what
    a launched run's stderr shows, less the timestamp)."""
    handler = None
    if log_file is not None and rank == 0:
        handler = logging.FileHandler(log_file)
        handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
        # On megabert's logger, not the root: main() configures the root's level and
        # stderr handler itself (logging.basicConfig), as in a launched process.
        logging.getLogger("megabert").addHandler(handler)
    try:
        rc = _entry(script).main([str(a) for a in argv])
    finally:
        if handler is not None:
            logging.getLogger("megabert").removeHandler(handler)
            handler.close()
    assert rc == 0, f"{script} exited with {rc} on rank {rank} of {world_size} (its error is on stderr above)"
