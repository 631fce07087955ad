"""The config dataclasses' field helper and the checks every section shares: a field carries
its CLI flag and help in its metadata (megabert.arguments builds the command line from it)."""
from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Any

from megabert.errors import ConfigError


def arg(default: Any = dataclasses.MISSING, help: str = "", *, flag: str | None = None,
        choices: tuple | None = None, factory: Any = None, cli: bool = True, aliases: tuple = ()) -> Any:
    """A dataclass field with the metadata `megabert.arguments` needs for its flag (`aliases`:
    other names of the same flag, e.g. Megatron's --tokenizer-model for --vocab-file)."""
    meta = {"help": help, "flag": flag, "choices": choices, "cli": cli, "aliases": aliases}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def flag_of(f: dataclasses.Field) -> str:
    """A config field's CLI flag: its `arg(flag=...)`, else --its-name."""
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def check_at_least(config, minimum: int, *names: str) -> None:
    """Each named field of `config` (None: not given, not checked) is at least `minimum`, else a
    one-line error that names its flag."""
    flags = {f.name: flag_of(f) for f in dataclasses.fields(config)}
    for name in names:
        value = getattr(config, name)
        if value is not None and value < minimum:
            raise ConfigError(f"{flags[name]} must be >= {minimum}, got {value}")
