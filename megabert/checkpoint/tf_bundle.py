"""TensorFlow's checkpoint format ("tensor bundle", Saver V2), read without TensorFlow.

A checkpoint PREFIX (e.g. `uncased_L-12_H-768_A-12/bert_model.ckpt`) is two kinds of file:

    PREFIX.index                       a LevelDB-format SSTable: variable name -> BundleEntryProto;
                                       the empty key holds the BundleHeaderProto
    PREFIX.data-00000-of-0000N         the tensors' raw bytes, back to back, in the header's byte order

Only the few protobuf fields we need are decoded, by hand: TensorFlow (and even the protobuf
package) would be a 500 MB run-time dependency for reading a few hundred tensors.
Facts used (tensorflow/core/util/tensor_bundle, tensorflow/core/lib/io/format.h, LevelDB's
doc/table_format.md):

- The footer is the last 48 bytes: metaindex and index BlockHandles (varint64 offset and
  size each), zero padding to 40 bytes, then the magic 0xdb4775248b80fb57 as fixed64.
- A block is followed by a 5-byte trailer: compression type (0 none, 1 snappy) and the
  masked crc32c of the block plus that type byte. TensorFlow writes bundles uncompressed.
- A block is a run of prefix-compressed entries (varint shared, non_shared, value_length,
  key suffix, value), then a uint32 restart array and its uint32 length.
- The index block maps the last key of each data block to that block's BlockHandle.
- BundleEntryProto: dtype=1 (enum), shape=2 (TensorShapeProto: repeated dim=2 {size=1}),
  shard_id=3, offset=4, size=5, crc32c=6 (fixed32), slices=7.
  BundleHeaderProto: num_shards=1, endianness=2 (0 little, 1 big).
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import Iterator

import torch

from megabert.errors import CheckpointError

_TABLE_MAGIC = 0xDB4775248B80FB57
_FOOTER_LEN = 48
_TRAILER_LEN = 5

# TensorFlow DataType enum values (tensorflow/core/framework/types.proto) -> torch dtypes.
_DTYPES = {1: torch.float32, 2: torch.float64, 3: torch.int32, 4: torch.uint8, 5: torch.int16, 6: torch.int8,
           9: torch.int64, 10: torch.bool, 14: torch.bfloat16, 17: torch.uint16, 19: torch.float16,
           22: torch.uint32, 23: torch.uint64}
_DTYPE_NAMES = {7: "string", 8: "complex64", 18: "complex128", 20: "resource", 21: "variant"}


@dataclass(frozen=True)
class BundleEntry:
    """Where one variable's bytes are, as the index says."""

    name: str
    dtype: int  # TensorFlow's DataType enum value
    shape: tuple
    shard_id: int
    offset: int
    size: int
    sliced: bool  # a partitioned variable stored as slices (not supported)


# ---------------------------------------------------------------- wire formats

def _crc32c_table() -> list:
    poly, table = 0x82F63B78, []  # Castagnoli, reflected
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ poly if c & 1 else c >> 1
        table.append(c)
    return table


_CRC_TABLE = _crc32c_table()


def masked_crc32c(data: bytes) -> int:
    """LevelDB's masked crc32c. Pure Python: used for the index's few kilobytes only (the
    tensor data would take minutes this way, so its checksums are not verified)."""
    crc = 0xFFFFFFFF
    for b in data:
        crc = _CRC_TABLE[(crc ^ b) & 0xFF] ^ (crc >> 8)
    crc ^= 0xFFFFFFFF
    # NOTE: the rotation + constant keeps a CRC of data that embeds CRCs from being trivial.
    return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    """(value, next position) of a base-128 varint at buf[pos]; IndexError when cut short."""
    value = shift = 0
    while True:
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise ValueError("varint longer than 10 bytes")


def _proto_fields(buf: bytes) -> Iterator[tuple[int, object]]:
    """(field number, value) of a serialized protobuf message: an int for varint and fixed
    fields, bytes for length-delimited ones. Unknown fields are simply yielded too."""
    pos = 0
    while pos < len(buf):
        tag, pos = _varint(buf, pos)
        field, wire = tag >> 3, tag & 7
        if wire == 0:
            value, pos = _varint(buf, pos)
        elif wire == 1:
            value, pos = struct.unpack_from("<Q", buf, pos)[0], pos + 8
        elif wire == 5:
            value, pos = struct.unpack_from("<I", buf, pos)[0], pos + 4
        elif wire == 2:
            n, pos = _varint(buf, pos)
            value, pos = buf[pos:pos + n], pos + n
            if pos > len(buf):
                raise ValueError("length-delimited field runs past the message")
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        yield field, value


def _signed64(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


def _parse_shape(buf: bytes) -> tuple:
    dims = []
    for field, value in _proto_fields(buf):
        if field == 2:  # Dim {int64 size = 1; string name = 2}
            dims.append(next((_signed64(v) for f, v in _proto_fields(value) if f == 1), 0))
        elif field == 3 and value:
            raise ValueError("unknown rank")
    return tuple(dims)


def _parse_entry(name: str, buf: bytes) -> BundleEntry:
    f = {"dtype": 0, "shape": (), "shard_id": 0, "offset": 0, "size": 0, "sliced": False}
    for field, value in _proto_fields(buf):
        if field == 1:
            f["dtype"] = value
        elif field == 2:
            f["shape"] = _parse_shape(value)
        elif field in (3, 4, 5):
            f[("shard_id", "offset", "size")[field - 3]] = _signed64(value)
        elif field == 7:
            f["sliced"] = True
    return BundleEntry(name=name, **f)


# ---------------------------------------------------------------- SSTable

def _handle(buf: bytes, pos: int = 0) -> tuple[int, int, int]:
    """(offset, size, next position) of a BlockHandle: two varint64s."""
    offset, pos = _varint(buf, pos)
    size, pos = _varint(buf, pos)
    return offset, size, pos


def _read_block(data: bytes, offset: int, size: int, path: str) -> bytes:
    end = offset + size + _TRAILER_LEN
    if end > len(data):
        raise CheckpointError(f"{path} is truncated (a block ends at byte {end} of {len(data)}); "
                              f"copy the checkpoint again")
    block, kind = data[offset:offset + size], data[offset + size]
    if kind != 0:
        raise CheckpointError(f"{path} has a compressed block (type {kind}); megabert reads uncompressed "
                              f"TensorFlow bundles only, as tf.train.Saver writes them")
    (stored,) = struct.unpack_from("<I", data, offset + size + 1)
    if masked_crc32c(block + bytes([kind])) != stored:
        raise CheckpointError(f"{path} is corrupt (block checksum mismatch at byte {offset}); "
                              f"copy the checkpoint again")
    return block


def _block_entries(block: bytes) -> Iterator[tuple[bytes, bytes]]:
    (num_restarts,) = struct.unpack_from("<I", block, len(block) - 4)
    end = len(block) - 4 - 4 * num_restarts
    if end < 0:
        raise ValueError("restart array larger than the block")
    pos, key = 0, b""
    while pos < end:
        shared, pos = _varint(block, pos)
        non_shared, pos = _varint(block, pos)
        value_len, pos = _varint(block, pos)
        key = key[:shared] + block[pos:pos + non_shared]
        pos += non_shared
        yield key, block[pos:pos + value_len]
        pos += value_len


def read_index(path: str) -> tuple[int, dict[str, BundleEntry]]:
    """(number of data shards, {variable name: entry}) of a PREFIX.index file."""
    if not os.path.isfile(path):
        raise CheckpointError(f"{path} does not exist: a TensorFlow checkpoint needs PREFIX.index and "
                              f"PREFIX.data-*; copy the complete checkpoint")
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < _FOOTER_LEN or struct.unpack_from("<Q", data, len(data) - 8)[0] != _TABLE_MAGIC:
        raise CheckpointError(f"{path} is not a TensorFlow checkpoint index (no table footer: truncated or "
                              f"another format); copy the checkpoint again")
    try:
        _, _, pos = _handle(data, len(data) - _FOOTER_LEN)  # metaindex: bundles keep no meta blocks
        index_offset, index_size, _ = _handle(data, pos)
        index_block = _read_block(data, index_offset, index_size, path)
        num_shards, big_endian, entries = 1, False, {}
        for _, handle in _block_entries(index_block):
            offset, size, _ = _handle(handle)
            for key, value in _block_entries(_read_block(data, offset, size, path)):
                if key == b"":
                    header = dict(_proto_fields(value))
                    num_shards, big_endian = header.get(1, 1), header.get(2, 0) == 1
                else:
                    name = key.decode("utf-8")
                    entries[name] = _parse_entry(name, value)
    except (IndexError, ValueError, struct.error, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is corrupt ({e}); copy the checkpoint again") from e
    if big_endian:
        raise CheckpointError(f"{path} was written on a big-endian machine; megabert reads little-endian bundles")
    return num_shards, entries


# ---------------------------------------------------------------- tensors

def data_file(prefix: str, shard_id: int, num_shards: int) -> str:
    return f"{prefix}.data-{shard_id:05d}-of-{num_shards:05d}"


def read_tensors(prefix: str, num_shards: int, entries: list[BundleEntry]) -> dict[str, torch.Tensor]:
    """Each entry's tensor, read from its data shard (one open file per shard)."""
    out: dict[str, torch.Tensor] = {}
    by_shard: dict[int, list[BundleEntry]] = {}
    for e in entries:
        _check_readable(e, prefix)
        by_shard.setdefault(e.shard_id, []).append(e)
    for shard, group in sorted(by_shard.items()):
        path = data_file(prefix, shard, num_shards)
        if not os.path.isfile(path):
            raise CheckpointError(f"{path} is missing: {prefix}.index refers to it; copy the complete checkpoint")
        with open(path, "rb") as f:
            for e in sorted(group, key=lambda e: e.offset):
                f.seek(e.offset)
                raw = bytearray(f.read(e.size))  # writable: torch.frombuffer shares it, no copy
                if len(raw) != e.size:
                    raise CheckpointError(f"{path} is truncated: {e.name} needs bytes {e.offset}-"
                                          f"{e.offset + e.size}, the file has {os.path.getsize(path)}; "
                                          f"copy the checkpoint again")
                out[e.name] = _to_tensor(raw, e, path)
    return out


def _check_readable(e: BundleEntry, prefix: str) -> None:
    if e.sliced:
        raise CheckpointError(f"{prefix}.index: {e.name} is a partitioned variable (stored as slices), "
                              f"which megabert does not read; re-save it unpartitioned")
    if e.dtype not in _DTYPES:
        what = _DTYPE_NAMES.get(e.dtype, f"DataType {e.dtype}")
        raise CheckpointError(f"{prefix}.index: {e.name} has dtype {what}, which megabert does not read "
                              f"(numeric tensors only)")


def _to_tensor(raw: bytearray, e: BundleEntry, path: str) -> torch.Tensor:
    dtype = _DTYPES[e.dtype]
    numel = 1
    for d in e.shape:
        numel *= d
    itemsize = torch.empty((), dtype=dtype).element_size()
    if numel * itemsize != e.size:
        raise CheckpointError(f"{path}: {e.name} has shape {list(e.shape)} but {e.size} bytes; the index and "
                              f"data files do not belong together")
    if numel == 0:
        return torch.empty(e.shape, dtype=dtype)
    return torch.frombuffer(raw, dtype=dtype).reshape(e.shape)
