"""The shards NVIDIA's own preprocessors made (tests/fixtures/nvidia, see its README) read by
megabert's public reader, row for row equal to what NVIDIA's own loader code made of them
(the .npz beside each shard)."""
import glob
import os

import numpy as np
import pytest

from megabert.tasks.pretraining import pretraining_samples

NVIDIA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "nvidia")
DLE_SHARDS = sorted(glob.glob(os.path.join(NVIDIA, "dle", "**", "*.hdf5"), recursive=True))
PHASE1 = os.path.join(NVIDIA, "dle", "hdf5_lower_case_1_seq_len_128_max_pred_20_masked_lm_prob_0.15_random_seed_12345_"
                      "dupe_factor_2", "pydocs")
VOCAB = os.path.join(NVIDIA, "text", "vocab.txt")


def test_fixtures_are_there():
    assert len(DLE_SHARDS) == 4 and os.path.isdir(PHASE1)


@pytest.mark.parametrize("path", DLE_SHARDS, ids=lambda p: os.path.relpath(p, NVIDIA).split("_seq_len_")[1].split("_")[0] + "-" + os.path.basename(p))
def test_dle_rows_equal_dle_pretraining_dataset(path):
    """Every row equals DLE's `pretraining_dataset` item (its -1 ignore index is our -100)."""
    ref = dict(np.load(path[:-len(".hdf5")] + ".dle_reference.npz"))  # each key decompressed once
    rows = pretraining_samples(path)
    assert len(rows) == len(ref["input_ids"]) > 0
    pairs = {"input_ids": "input_ids", "token_type_ids": "segment_ids", "attention_mask": "input_mask"}
    equal = 0
    for i, row in enumerate(rows):
        same = all(np.array_equal(row[k].numpy(), ref[r][i]) for k, r in pairs.items())
        same &= np.array_equal(row["labels"].numpy(), np.where(ref["masked_lm_labels"][i] == -1, -100,
                                                                 ref["masked_lm_labels"][i]))
        same &= row["next_sentence_label"].shape == () and int(row["next_sentence_label"]) == \
            ref["next_sentence_labels"][i]
        equal += bool(same)
    assert equal == len(rows), f"{equal} of {len(rows)} rows equal"
