"""config.json fields the RoPE families read alike: the RoPE base (transformers 5's
`rope_parameters`, or an older top-level `rope_theta`) and a checked activation name."""
from __future__ import annotations

from megabert.config import MODERNBERT_ACTIVATIONS
from megabert.errors import CheckpointError


def rope_theta(hf: dict, default: float, family: str, layer_type: str = "") -> float:
    """The RoPE base of config.json (of `layer_type`'s entry when rope_parameters is keyed by
    layer type), `default` where it says none; any other rope_type than the default is refused."""
    params = hf.get("rope_parameters") or {}
    if layer_type and layer_type in params:
        params = params[layer_type] or {}
    kind = params.get("rope_type", "default")
    if kind != "default" or hf.get("rope_scaling"):
        raise CheckpointError(f"config.json asks for rope_type {kind if kind != 'default' else hf['rope_scaling']}; "
                              f"megabert's {family} implements the default RoPE only")
    return float(params.get("rope_theta", hf.get("rope_theta", default)))


def checked_activation(hf: dict, default: str, family: str, key: str = "hidden_act") -> str:
    act = hf.get(key, default)
    if act not in MODERNBERT_ACTIVATIONS:
        raise CheckpointError(f"config.json has {key} {act!r}; megabert's {family} takes "
                              f"{', '.join(MODERNBERT_ACTIVATIONS)}")
    return act
