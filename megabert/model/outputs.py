"""Model outputs: dicts with attribute access, as transformers' ModelOutput, so tools that
walk a module's outputs for tensors (an engine's backward hooks that gather partitioned
parameters, for one) find them.
Each task's output subclasses it in its own package (megabert.tasks.*.model)."""
from __future__ import annotations


class ModelOutput(dict):
    def __getattr__(self, name: str):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"{type(self).__name__} has no field {name!r}") from None
