"""The shards NVIDIA's own preprocessors made (tests/fixtures/nvidia, see its README) read by
megabert's public reader, row for row equal to what NVIDIA's own loader code made of them
(the .npz references: DLE's `pretraining_dataset`, LDDL's `_to_encoded_inputs`)."""
import glob
import os

import numpy as np
import pytest

from megabert.tasks.pretraining import pretraining_samples
from megabert.tasks.pretraining.lddl_parquet import non_special
from tests.helpers.nvidia_shards import DLE, DLE_PHASE1, LDDL, NVIDIA, NVIDIA_VOCAB as VOCAB

DLE_SHARDS = sorted(p for p in glob.glob(os.path.join(DLE, "**", "*.hdf5"), recursive=True))
LDDL_VARIANTS = ("phase1_static", "phase1_dynamic", "phase2_static_binned")
LDDL_SHARDS = sorted(p for v in LDDL_VARIANTS for p in glob.glob(os.path.join(LDDL, v, "shard-*")))


def _id(path):
    rel = os.path.relpath(path, NVIDIA)
    return rel.split("_seq_len_")[1].split("_")[0] + "-" + os.path.basename(rel) if "seq_len" in rel else rel[5:]


def test_fixtures_are_there():
    assert len(DLE_SHARDS) == 4 and os.path.isdir(DLE_PHASE1)
    assert len(LDDL_SHARDS) == 2 + 2 + 16


def _ignore(labels):
    return np.where(labels == -1, -100, labels)  # NVIDIA's loaders ignore -1; megabert (and torch) -100


@pytest.mark.parametrize("path", DLE_SHARDS, ids=_id)
def test_dle_rows_equal_dle_pretraining_dataset(path):
    """Every row equals DLE's `pretraining_dataset` item."""
    npz = os.path.join(DLE, "reference", os.path.relpath(path, DLE))[:-len(".hdf5")] + ".npz"
    ref = dict(np.load(npz))  # each key decompressed once
    rows = pretraining_samples(path)
    assert len(rows) == len(ref["input_ids"]) > 0
    pairs = {"input_ids": "input_ids", "token_type_ids": "segment_ids", "attention_mask": "input_mask"}
    equal = 0
    for i, row in enumerate(rows):
        same = all(np.array_equal(row[k].numpy(), ref[r][i]) for k, r in pairs.items())
        same &= np.array_equal(row["labels"].numpy(), _ignore(ref["masked_lm_labels"][i]))
        same &= row["next_sentence_label"].shape == () and int(row["next_sentence_label"]) == \
            ref["next_sentence_labels"][i]
        equal += bool(same)
    assert equal == len(rows), f"{equal} of {len(rows)} rows equal"


@pytest.mark.parametrize("path", LDDL_SHARDS, ids=_id)
def test_lddl_rows_equal_lddl_encoding(path):
    """Every row equals LDDL's encoding up to its length (LDDL pads the batch with 0 / -1 after
    it); dynamic rows carry no labels and may mask exactly what LDDL's special_tokens_mask allows."""
    variant = os.path.basename(os.path.dirname(path))
    ref = dict(np.load(os.path.join(LDDL, "reference", variant, os.path.basename(path) + ".npz")))
    rows = pretraining_samples(path, vocab_file=VOCAB)
    assert len(rows) == len(ref["input_ids"]) > 0
    equal = 0
    for i, row in enumerate(rows):
        n = int(ref["lengths"][i])
        same = len(row["input_ids"]) == n and int(row["next_sentence_label"]) == ref["next_sentence_labels"][i]
        same &= all(np.array_equal(row[k].numpy(), ref[k][i, :n]) for k in ("input_ids", "token_type_ids",
                                                                              "attention_mask"))
        same &= not ref["input_ids"][i, n:].any() and not ref["attention_mask"][i, n:].any()
        if "labels" in ref:
            same &= np.array_equal(row["labels"].numpy(), _ignore(ref["labels"][i, :n]))
            same &= bool((ref["labels"][i, n:] == -1).all())
        else:
            same &= bool((row["labels"] == -100).all())
            same &= np.array_equal(non_special(row["token_type_ids"].numpy()), ref["special_tokens_mask"][i, :n] == 0)
        equal += bool(same)
    assert equal == len(rows), f"{equal} of {len(rows)} rows equal"
