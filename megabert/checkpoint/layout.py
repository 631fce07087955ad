"""Megatron's checkpoint layout, written atomically.

    ROOT/latest_checkpointed_iteration.txt        "release" or the iteration number
    ROOT/iter_0000100/mp_rank_TT[_PPP]/model_optim_rng.pt
    ROOT/release/...                              (converted, not trained)

A save goes to `ITER.tmp/`, each file is fsynced, the directory is renamed into place
and only then does the pointer file change (itself via rename). A job killed mid-save
leaves the previous checkpoint and pointer intact. Files are read through safe_pickle's
allow-list: a checkpoint holds tensors and plain Python values only.
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import zipfile
from dataclasses import asdict, dataclass
from typing import Optional, Union

import torch

from megabert.checkpoint import safe_pickle
from megabert.checkpoint.safe_pickle import TENSORS, Allowed
from megabert.checkpoint.sharding import repad_vocab, shard_state
from megabert.config import ModelConfig
from megabert.errors import CheckpointError
from megabert.parallel.layout import StageLayout
from megabert.parallel.param_spec import table_to_dict

TRACKER = "latest_checkpointed_iteration.txt"
FILENAME = "model_optim_rng.pt"
CHECKPOINT_VERSION = 3.0
_RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?$")


def tag_dir_name(tag: Union[int, str]) -> str:
    return "release" if tag == "release" else f"iter_{int(tag):07d}"


def rank_dir_name(tp_rank: int, pp_rank: int, pp_size: int) -> str:
    return f"mp_rank_{tp_rank:02d}" if pp_size == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_tracker(root: str) -> Optional[str]:
    path = os.path.join(root, TRACKER)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        tag = f.read().strip()
    if tag != "release" and not tag.isdigit():
        raise CheckpointError(f"{path} holds {tag!r}, neither an iteration number nor 'release'")
    return tag


def has_checkpoint(path: str) -> bool:
    """Whether `path` holds a committed checkpoint: a pointer file, or rank directories (an
    iteration directory itself). A directory holding only metrics or TensorBoard files, or
    a save killed before its first commit (`ITER.tmp/`), holds none. A pointer to a missing
    iteration counts as a checkpoint, so the load that follows reports it instead of a
    restart silently starting over."""
    if not os.path.isdir(path):
        return False
    return os.path.isfile(os.path.join(path, TRACKER)) or any(_RANK_DIR.match(n) for n in os.listdir(path))


def resolve_checkpoint_dir(path: str) -> str:
    """ROOT (with the pointer file) or an iteration directory itself -> the iteration directory."""
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint {path} does not exist")
    tag = read_tracker(path)
    if tag is not None:
        d = os.path.join(path, tag_dir_name(tag))
        if not os.path.isdir(d):
            raise CheckpointError(f"{os.path.join(path, TRACKER)} points to {d}, which does not exist")
        return d
    if any(_RANK_DIR.match(n) for n in os.listdir(path)):
        return path
    raise CheckpointError(f"{path} is neither a megabert/Megatron checkpoint (no {TRACKER}, no mp_rank_* "
                          f"directories) nor a Hugging Face BERT directory (config.json + weights)")


@dataclass(frozen=True)
class SavedLayout:
    """The TP x PP grid of a checkpoint directory, read once from its rank directories:
    {(tp_rank, pp_rank): file}, checked to be a full grid."""

    files: dict
    tp_size: int
    pp_size: int

    def grid(self, payloads: dict) -> list[list[dict]]:
        """payloads by (tp, pp) -> [pp][tp]."""
        return [[payloads[(t, p)] for t in range(self.tp_size)] for p in range(self.pp_size)]


def saved_layout(ckpt_dir: str) -> SavedLayout:
    found = {}
    for name in os.listdir(ckpt_dir):
        m = _RANK_DIR.match(name)
        if m:
            f = os.path.join(ckpt_dir, name, FILENAME)
            if not os.path.isfile(f):
                raise CheckpointError(f"{f} is missing: the checkpoint is incomplete")
            found[(int(m.group(1)), int(m.group(2) or 0))] = f
    if not found:
        raise CheckpointError(f"{ckpt_dir} holds no mp_rank_* directories")
    tp = max(t for t, _ in found) + 1
    pp = max(p for _, p in found) + 1
    if len(found) != tp * pp:
        raise CheckpointError(f"{ckpt_dir} holds {len(found)} rank directories, expected tp {tp} x pp {pp}")
    return SavedLayout(found, tp, pp)


def checkpoint_root(path: str) -> str:
    """ROOT, for ROOT itself or one of its iteration directories (ROOT/iter_0000100)."""
    if read_tracker(path) is None and re.fullmatch(r"iter_\d{7}|release", os.path.basename(os.path.normpath(path))):
        return os.path.dirname(os.path.normpath(path))
    return path


def damaged_file(ckpt_dir: str) -> Optional[str]:
    """'FILE (why)' for the first rank file of an iteration directory that cannot be read
    (missing, or truncated: torch's zip format keeps its index at the end of the file),
    else None. Reads each file's index only, not its tensors."""
    try:
        files = saved_layout(ckpt_dir).files
    except CheckpointError as e:
        return str(e)
    for f in sorted(files.values()):
        try:
            with zipfile.ZipFile(f) as z:
                if not any(n.endswith("data.pkl") for n in z.namelist()):
                    return f"{f} (no data.pkl: not a torch.save file)"
        except (zipfile.BadZipFile, OSError) as e:
            return f"{f} ({e})"
    return None


def newest_intact(root: str) -> Optional[tuple[str, int]]:
    """(iteration directory, iteration) of the newest iteration under ROOT whose rank files
    all read (see damaged_file), or None."""
    iterations = sorted((int(m.group(1)) for n in os.listdir(root) if (m := re.fullmatch(r"iter_(\d{7})", n))),
                        reverse=True)
    for it in iterations:
        d = os.path.join(root, tag_dir_name(it))
        if damaged_file(d) is None:
            return d, it
    return None


#: What megabert's own rank files hold: tensors and plain Python values (safe_pickle.TENSORS).
OWN_FILES = Allowed("megabert checkpoint", TENSORS)


def load_file(path: str, mmap: bool = False) -> dict:
    """`mmap`: map the file instead of reading it; a tensor's bytes are read when it is used.
    Read through safe_pickle: a file naming anything but tensors and plain values is refused."""
    payload = safe_pickle.load(path, OWN_FILES, mmap=mmap)
    if not isinstance(payload, dict):
        raise safe_pickle.wrong_type(path, payload, "the dict megabert saves", OWN_FILES.kind)
    for key in ("model", "model_config"):
        if not isinstance(payload.get(key), dict):
            raise safe_pickle.wrong_type(path, payload.get(key), f"its '{key}' (a dict)", OWN_FILES.kind)
    for key, kinds in _OWN_ENTRIES.items():
        value = payload.get(key)
        if value is not None and (not isinstance(value, kinds) or isinstance(value, bool)):
            raise safe_pickle.wrong_type(path, value, f"its '{key}' (a {kinds.__name__})", OWN_FILES.kind)
    bad = next(((k, v) for k, v in payload["model"].items() if not isinstance(k, str) or not torch.is_tensor(v)), None)
    if bad is not None:
        raise safe_pickle.wrong_type(path, bad[1], f"tensor {str(bad[0])[:80]!r}", OWN_FILES.kind)
    return payload


# The other entries of a rank file megabert reads, with their types (None where absent).
_OWN_ENTRIES = {"args": dict, "rng": dict, "optimizer": dict, "parallel": dict, "param_specs": dict,
                "loss_scaler": dict, "iteration": int, "consumed_samples": int, "skipped_iterations": int}


def staging_dir(root: str, tag: Union[int, str]) -> str:
    return os.path.join(root, tag_dir_name(tag) + ".tmp")


def write_rank_file(stage: str, tp_rank: int, pp_rank: int, pp_size: int, payload: dict) -> str:
    d = os.path.join(stage, rank_dir_name(tp_rank, pp_rank, pp_size))
    os.makedirs(d, exist_ok=True)
    final = os.path.join(d, FILENAME)
    tmp = final + ".part"
    with open(tmp, "wb") as f:
        torch.save(payload, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    _fsync_dir(d)
    return final


def commit(root: str, tag: Union[int, str]) -> str:
    """Moves the staged directory into place, then updates the pointer. Call once (rank 0)
    after every rank's write_rank_file has returned (a barrier)."""
    stage, final = staging_dir(root, tag), os.path.join(root, tag_dir_name(tag))
    for d in os.listdir(stage):
        _fsync_dir(os.path.join(stage, d))
    resaved = os.path.exists(final)
    if resaved:  # re-saving an iteration: the new one wins
        old = final + ".old"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(stage, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(stage, final)
    _fsync_dir(root)
    tmp = os.path.join(root, TRACKER + ".tmp")
    try:
        with open(tmp, "w") as f:
            f.write(str(tag))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(root, TRACKER))
    except OSError:
        # The pointer still names the previous checkpoint: take back the directory it does
        # not name, so a failed save leaves nothing of its own behind.
        if not resaved:
            shutil.rmtree(final, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    _fsync_dir(root)
    return final


def os_error_behind(error: BaseException) -> Optional[OSError]:
    """The OSError behind `error`, if any: torch.save reports a failed write (a full disk)
    as its own RuntimeError ("unexpected pos"), raised while the OSError was handled."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, OSError):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def parallel_meta(tp_size: int, pp_size: int, layers_per_virtual_stage: Optional[int] = None) -> dict:
    meta = {"tensor_model_parallel_size": tp_size, "pipeline_model_parallel_size": pp_size}
    if layers_per_virtual_stage:
        meta["num_layers_per_virtual_pipeline_stage"] = layers_per_virtual_stage
    return meta


def saved_virtual_stage_layers(payload: dict) -> Optional[int]:
    """The interleaved chunk size a rank file was saved with (None: one chunk per stage)."""
    return (payload.get("parallel") or {}).get("num_layers_per_virtual_pipeline_stage")


def model_payload(state: dict, cfg: ModelConfig, *, tp_size: int, pp_size: int, model_class: str,
                  param_specs: dict, iteration: int = 0, layers_per_virtual_stage: Optional[int] = None,
                  **extra) -> dict:
    """One rank file's content. `param_specs`: {name: ParamSpec.to_dict()} of this rank's
    tensors, so offline tools shard and merge from the model's own descriptions."""
    return {"checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration, "model": state,
            "model_config": asdict(cfg), "model_class": model_class, "param_specs": param_specs,
            "parallel": parallel_meta(tp_size, pp_size, layers_per_virtual_stage), **extra}


def save_full_model(root: str, full: dict, cfg: ModelConfig, table: dict, *, tp_size: int, pp_size: int,
                    model_class: str, tag: Union[int, str] = "release") -> str:
    """Writes every rank's shard of a full state dict from one process (conversion, resharding)."""
    stage = staging_dir(root, tag)
    full = repad_vocab(full, table, cfg.padded_vocab_size(tp_size))
    try:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(stage, ignore_errors=True)
        for pp in range(pp_size):
            for tp in range(tp_size):
                local = shard_state(full, table, tp_rank=tp, tp_size=tp_size,
                                    stage=StageLayout(cfg.num_layers, pp_size, pp))
                specs = table_to_dict({k: table[k] for k in local})
                write_rank_file(stage, tp, pp, pp_size, model_payload(
                    local, cfg, tp_size=tp_size, pp_size=pp_size, model_class=model_class, param_specs=specs,
                    iteration=0 if tag == "release" else int(tag)))
        return commit(root, tag)
    except Exception as e:
        os_error = os_error_behind(e)
        if os_error is None:
            raise
        shutil.rmtree(stage, ignore_errors=True)
        raise CheckpointError(f"cannot write the checkpoint {os.path.join(root, tag_dir_name(tag))}: {os_error}; "
                              f"nothing of it was kept: make room, fix the permissions or choose another "
                              f"output directory") from e

