"""The shell commands of README.md and docs/*.md, as a user would copy them: each ```bash block's
lines, continuations (a trailing backslash) joined, comments dropped; and the flags each gives
to a script of this repo (a launcher's own flags, before the script, are the launcher's)."""
from __future__ import annotations

import glob
import os
import re
import shlex
from dataclasses import dataclass

from tests.helpers.cli_utils import ROOT

SHELL_FENCES = ("bash", "sh", "shell", "console")
SCRIPT = re.compile(r"^[\w./-]+\.py$")
# Subcommands: the flags after them are the subcommand's (`convert_hf.py import --hf-dir`).
SUBCOMMANDS = {"tools/checkpoint/convert_hf.py": ("import", "export"),
               "tools/checkpoint/convert_megatron.py": ("import", "export")}


@dataclass(frozen=True)
class Command:
    doc: str  # the file, relative to the repo
    line: int  # where the command starts
    text: str  # the whole command, continuations joined
    script: str | None  # the repo's script it runs (relative path), or None (a launcher script, a peer's)
    subcommand: str | None
    flags: tuple[str, ...]  # --flags given to the script, as typed (no =value)

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"


def doc_files() -> list[str]:
    return ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))


def commands(doc: str) -> list[Command]:
    """Every command in `doc`'s shell blocks, in order."""
    out, fence, pending, start = [], None, "", 0
    for number, line in enumerate(open(os.path.join(ROOT, doc), encoding="utf-8"), start=1):
        if line.startswith("```"):
            fence = None if fence is not None else line[3:].strip() or "text"
            continue
        if fence not in SHELL_FENCES:
            continue
        text = line.split(" #", 1)[0].rstrip() if not line.lstrip().startswith("#") else ""
        if not pending:
            start = number
        if text.endswith("\\"):
            pending += text[:-1] + " "
            continue
        whole = (pending + text).strip()
        pending = ""
        if whole:
            out.append(_command(doc, start, whole))
    return out


def _command(doc: str, line: int, text: str) -> Command:
    # Optional parts written as [--flag value ...] and alternatives a|b are documentation, not shell.
    tokens = shlex.split(text.replace("[", " ").replace("]", " "), posix=True)
    at = next((i for i, t in enumerate(tokens) if SCRIPT.match(t)), None)
    script = tokens[at] if at is not None else None
    if script is not None and not os.path.isfile(os.path.join(ROOT, script)):
        script = None  # a peer's script (transformers' run_glue.py): not ours to check
    rest = tokens[at + 1:] if at is not None else []
    sub = rest[0] if script in SUBCOMMANDS and rest and rest[0] in SUBCOMMANDS[script] else None
    flags = tuple(t.split("=", 1)[0] for t in rest if t.startswith("--"))
    return Command(doc, line, text, script, sub, flags)


HELP_FLAG = re.compile(r"(?<![\w-])(--[A-Za-z0-9][\w-]*)")


def help_flags(help_text: str) -> set[str]:
    """The --flags a script's --help lists."""
    return set(HELP_FLAG.findall(help_text))
