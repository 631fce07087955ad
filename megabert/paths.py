"""Preflight of paths: every file a run reads and every place it writes, checked when the flags
are parsed, before a process group, a tokenizer or a model exists.

A run that trains for an hour and then finds its --output-dir is a file wastes the hour; a
directory given as --train-file is not "missing". Each check here says, in one line naming the
flag, which of these it is: does not exist, is a directory where a file belongs (or the other
way round), cannot be read, cannot be created, cannot be written.

Writability is tested by doing it (a probe file created and removed), not with os.access: as
root a read-only mode (chmod 555) still lets a write through, while a read-only mount, a full
disk or a quota stops it whatever the mode bits say.

The entry scripts built from the config dataclasses check their fields through
`check_config_paths` (the field names below mean the same thing in every section and task);
the argparse tools (preprocess_data.py, the checkpoint converters) call the checks directly.
"""
from __future__ import annotations

import dataclasses
import errno
import os
import tempfile
from typing import Iterable

from megabert.config_fields import flag_of
from megabert.errors import ConfigError, DataError

FILE, DIR, FILE_OR_DIR = "file", "directory", "file or directory"
OUT_DIR, OUT_FILE = "output directory", "output file"

# Config field name -> what the flag takes. Fields not named here are not paths, or are checked
# where their meaning is decided: --load and --pretrained-checkpoint (a checkpoint directory, a
# TF checkpoint prefix, or under the restart pattern --save X --load X a directory that does not
# exist yet: megabert.checkpoint.start), --data-path (dataset prefixes, weights, shard globs:
# megabert.data.shard_sources).
CONFIG_PATHS = {
    "vocab_file": FILE_OR_DIR,  # vocab.txt, a SentencePiece model, a tokenizer.json or its directory
    "deepspeed_config": FILE,
    "train_file": FILE,
    "validation_file": FILE,
    "test_file": FILE,
    "predict_file": FILE,
    "data_dir": DIR,
    "eval_dir": DIR,
    "save": OUT_DIR,
    "output_dir": OUT_DIR,
    "tensorboard_dir": OUT_DIR,
    "data_cache_path": OUT_DIR,
    "metrics_file": OUT_FILE,
}


def check_config_paths(configs) -> None:
    """Checks every path field (CONFIG_PATHS) of every config section in `configs` (a Configs or
    FinetuneConfigs): a list field item by item. Raises DataError (an input) or ConfigError (an
    output) with one line naming the flag."""
    for section in dataclasses.fields(configs):
        config = getattr(configs, section.name)
        if not dataclasses.is_dataclass(config):
            continue
        for f in dataclasses.fields(config):
            kind = CONFIG_PATHS.get(f.name)
            value = getattr(config, f.name)
            if kind is None or value is None or not f.metadata.get("cli", True):
                continue
            for path in value if isinstance(value, (list, tuple)) else [value]:
                check_path(str(path), flag_of(f), kind)


def check_path(path: str, flag: str, kind: str) -> None:
    """One path against what `flag` takes (FILE, DIR, FILE_OR_DIR, OUT_DIR, OUT_FILE)."""
    if kind == OUT_DIR:
        check_output_dir(path, flag)
    elif kind == OUT_FILE:
        check_output_file(path, flag)
    else:
        check_input(path, flag, kind)


def check_input(path: str, flag: str, kind: str = FILE) -> None:
    """`path` exists, is a file or a directory as `kind` says, and can be read."""
    if not os.path.exists(path):
        if os.path.islink(path):
            raise DataError(f"{flag} {path} is a link to {os.readlink(path)}, which does not exist")
        parent = os.path.dirname(os.path.abspath(path))
        where = "" if os.path.isdir(parent) else f" (nor does its directory {parent})"
        raise DataError(f"{flag} {path} does not exist{where}")
    if kind == FILE and os.path.isdir(path):
        raise DataError(f"{flag} {path} is a directory; it takes a file{_files_in(path)}")
    if kind == DIR and not os.path.isdir(path):
        raise DataError(f"{flag} {path} is a file; it takes a directory")
    try:
        if os.path.isdir(path):
            os.listdir(path)
        else:
            with open(path, "rb") as f:
                f.read(1)
    except OSError as e:
        raise DataError(f"{flag} {path} cannot be read ({_why(e)}): check its permissions") from None


def check_output_dir(path: str, flag: str) -> None:
    """`path` is a directory that can be written, or one that can be created: the nearest part of
    it that exists is a writable directory."""
    if os.path.isdir(path):
        _probe(path, flag, path)
        return
    if os.path.lexists(path):
        raise ConfigError(f"{flag} {path} is a file, not a directory: remove it or choose another path")
    existing = _nearest_existing(path)
    if not os.path.isdir(existing):
        raise ConfigError(f"{flag} {path} cannot be created: {existing} is a file, not a directory")
    _probe(existing, flag, path)


def check_output_file(path: str, flag: str) -> None:
    """`path` is a file that can be appended to, or one that can be created in a directory that
    exists or can be made."""
    if os.path.isdir(path):
        raise ConfigError(f"{flag} {path} is a directory; it takes a file name (e.g. {os.path.join(path, 'out')})")
    if os.path.exists(path):
        try:
            with open(path, "ab"):
                pass
        except OSError as e:
            raise ConfigError(f"{flag} {path} cannot be written ({_why(e)}): choose a file you can write") from None
        return
    check_output_dir(os.path.dirname(os.path.abspath(path)), flag)


def check_output_prefix(prefix: str, flag: str) -> None:
    """A prefix the output files' names start with (preprocess_data.py's P_text_sentence.bin):
    its directory must be writable or creatable."""
    check_output_dir(os.path.dirname(os.path.abspath(prefix)), f"{flag} {prefix}: directory")


def _probe(directory: str, flag: str, path: str) -> None:
    try:
        fd, probe = tempfile.mkstemp(prefix=".megabert-write-check-", dir=directory)
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        made = "written" if directory == path else f"created in {directory}"
        raise ConfigError(f"{flag} {path} cannot be {made} ({_why(e)}): choose a directory you can write "
                          f"to") from None


def _nearest_existing(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.lexists(path):
        path = os.path.dirname(path)
    return path


def _files_in(directory: str, limit: int = 3) -> str:
    try:
        names = sorted(n for n in os.listdir(directory) if os.path.isfile(os.path.join(directory, n)))
    except OSError:
        return ""
    if not names:
        return ""
    shown = ", ".join(names[:limit]) + (", ..." if len(names) > limit else "")
    return f" such as one of its files ({shown})"


def _why(e: OSError) -> str:
    if e.errno == errno.EROFS:
        return "read-only file system"
    return e.strerror or type(e).__name__


def check_paths(paths: Iterable[tuple[str | None, str, str]]) -> None:
    """(path, flag, kind) triples, None paths skipped: the argparse tools' one call."""
    for path, flag, kind in paths:
        if path is not None:
            check_path(path, flag, kind)
