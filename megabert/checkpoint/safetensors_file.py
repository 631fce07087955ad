"""A safetensors file from outside, read with every fault one line that names the file.

The format (huggingface/safetensors): an 8-byte little-endian header length N, N bytes of JSON
`{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}`, then the
tensor bytes, each tensor at [begin, end) of that data block, the blocks covering it exactly.
The library's own errors ("incomplete metadata, file not fully covered", "No such device") name
neither the file nor what to do, so the header is checked here first; then the tensors are
read by the library and checked for NaN and infinite values, which no trained checkpoint holds
and which would train on silently as NaN losses.
"""
from __future__ import annotations

import json
import math
import os
import struct

import torch

from megabert.errors import CheckpointError

# Bytes per element of each dtype the format names.
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
               "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
# A header larger than this is damage, not a checkpoint (the library's own limit is 100 MB).
MAX_HEADER_BYTES = 100_000_000
AGAIN = "download or export it again"


def read_safetensors(path: str) -> dict[str, torch.Tensor]:
    """{name: tensor} of `path`, after `check_safetensors_header`; a tensor with NaN or infinite
    values is refused, naming it."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    check_safetensors_header(path)
    try:
        state = load_file(path)
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{path} cannot be read as safetensors ({e}); {AGAIN}") from None
    for name, tensor in state.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            bad = int((~torch.isfinite(tensor)).sum())
            raise CheckpointError(f"{path}: tensor {name} holds {bad} NaN or infinite value(s) of {tensor.numel()}; "
                                  f"the weights are damaged (a diverged run, or a broken copy): {AGAIN}, or load an "
                                  f"earlier checkpoint")
    return state


def check_safetensors_header(path: str) -> dict:
    """The header of `path` (tensor entries only), checked against the file's size: a file too
    short for its header or its tensors is truncated, a header that is not JSON or names a
    dtype, shape or range that does not fit is damaged."""
    if os.path.islink(path) and not os.path.exists(path):
        raise CheckpointError(f"{path} is a link to {os.readlink(path)}, which does not exist")
    if not os.path.isfile(path):
        raise CheckpointError(f"{path} is a directory, not a safetensors file" if os.path.isdir(path) else
                              f"{path} does not exist")
    size = os.path.getsize(path)
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path} is {size} bytes, too short for a safetensors header: the file is "
                                      f"truncated or empty; {AGAIN}")
            (n,) = struct.unpack("<Q", head)
            if n > min(MAX_HEADER_BYTES, size - 8):
                raise CheckpointError(f"{path}: its header says {n} bytes but the file has {size - 8} after the "
                                      f"length: truncated, or not a safetensors file; {AGAIN}")
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"{path} cannot be read ({e.strerror}): check its permissions") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: the safetensors header is not JSON ({e}); the file is damaged or not "
                              f"safetensors; {AGAIN}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: the safetensors header is a JSON {type(header).__name__}, not an object; "
                              f"{AGAIN}")
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    data = size - 8 - n
    covered = 0
    for name, entry in sorted(tensors.items(), key=lambda kv: _begin(kv[1])):
        _check_entry(path, name, entry, data)
        begin, end = entry["data_offsets"]
        if begin != covered:
            raise CheckpointError(f"{path}: tensor {name} starts at byte {begin} of the data, the one before it ends "
                                  f"at {covered}: the header is damaged; {AGAIN}")
        covered = end
    if covered != data:
        what = "truncated" if covered > data else "longer than its header says"
        raise CheckpointError(f"{path}: its tensors need {covered} bytes of data, the file holds {data}: {what}; "
                              f"{AGAIN}")
    return tensors


def _begin(entry) -> int:
    offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
    return offsets[0] if isinstance(offsets, list) and offsets and isinstance(offsets[0], int) else -1


def _check_entry(path: str, name: str, entry, data: int) -> None:
    where = f"{path}: tensor {name}"
    if not isinstance(entry, dict):
        raise CheckpointError(f"{where}: its header entry is not an object; {AGAIN}")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPE_BYTES:
        raise CheckpointError(f"{where} has dtype {dtype!r}, not one safetensors defines; {AGAIN}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise CheckpointError(f"{where} has shape {shape!r}, not a list of sizes; {AGAIN}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
            and 0 <= offsets[0] <= offsets[1]):
        raise CheckpointError(f"{where} has data_offsets {offsets!r}, not [begin, end]; {AGAIN}")
    if offsets[1] > data:
        raise CheckpointError(f"{where} ends at byte {offsets[1]} of the data, the file holds {data}: the file is "
                              f"truncated or its header damaged; {AGAIN}")
    need = math.prod(shape) * DTYPE_BYTES[dtype]
    if offsets[1] - offsets[0] != need:
        raise CheckpointError(f"{where}: {dtype} {shape} needs {need} bytes, its data_offsets span "
                              f"{offsets[1] - offsets[0]}; the header is damaged; {AGAIN}")
