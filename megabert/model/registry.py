"""Task model classes by name: a checkpoint records its model's class name, and tools
(conversion, resharding, exports) turn that name back into a class or a spec table.
Each task package registers its model where it defines it (`@register_model`);
`megabert.tasks.model_classes()` imports every task package and returns them all."""
from __future__ import annotations

import dataclasses

from megabert.parallel.param_spec import register_reference_table, spec_table

MODEL_CLASSES: dict[str, type] = {}


def register_model(cls: type) -> type:
    """Class decorator: known by name to checkpoints and tools from now on."""
    MODEL_CLASSES[cls.__name__] = cls
    register_reference_table(cls.__name__, lambda cfg: _meta_table(cls, cfg))
    return cls


def meta_model(cls: type, cfg):
    """A whole model of `cls` (one rank, TP=PP=1) built on the meta device: shapes and specs,
    no memory, no process group, no numbers."""
    from megabert.parallel.state import ParallelState

    shape_only = dataclasses.replace(cfg, attention_backend="torch", layernorm_backend="torch",
                                     dropout_add_backend="torch")
    return cls(shape_only, ParallelState.offline(), device="meta")


def _meta_table(cls: type, cfg) -> dict:
    """The spec table of a whole model built on the meta device."""
    return spec_table(meta_model(cls, cfg))
