"""One package per task: its data, features, model head, loss, metrics and the glue that
hands them to the generic trainer (megabert.training). A new task is one package here and
one entry script; nothing outside them changes."""
from __future__ import annotations

import importlib
import pkgutil


def model_classes() -> dict[str, type]:
    """Every model class by name (BertModel and each task's), for tools that read a
    checkpoint's model class: imports each task package's `model` module once."""
    from megabert.model.registry import MODEL_CLASSES

    for info in pkgutil.iter_modules(__path__):
        if info.ispkg:
            importlib.import_module(f"{__name__}.{info.name}.model")
    return dict(MODEL_CLASSES)
