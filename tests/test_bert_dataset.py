"""BERT samples: structure, SOP/NSP, masking statistics, determinism across runs/workers/DP sizes,
splits, blends, the mapping cache, and clear errors instead of hangs."""
import os
import warnings

import numpy as np
import pytest
import torch

from megabert.config import DataConfig
from megabert.tasks.pretraining.sample_mapping import DataWarning
from megabert.data import IndexedDataset, IndexedDatasetWriter, build_pretraining_data_loader, build_tokenizer
from megabert.tasks.pretraining.indexed_splits import build_train_valid_test_datasets
from megabert.tasks.pretraining.indexed_samples import truncate_pair
from megabert.tasks.pretraining.masking import IGNORE_INDEX
from megabert.tasks.pretraining.sample_mapping import build_mapping
from megabert.errors import DataError

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
N_WORDS = 30000  # every corpus token is unique, so a token id tells where in the corpus it came from


@pytest.fixture(scope="module")
def vocab(tmp_path_factory):
    path = tmp_path_factory.mktemp("vocab") / "vocab.txt"
    # Ids 5.. alternate word starts and "##" continuations in runs, for whole-word masking.
    words = [f"##p{i}" if i % 3 else f"w{i}" for i in range(N_WORDS)]
    path.write_text("\n".join(SPECIALS + words) + "\n", encoding="utf-8")
    return str(path)


@pytest.fixture(scope="module")
def tok(vocab):
    return build_tokenizer("BertWordPieceLowerCase", vocab)


def write_corpus(prefix, n_docs, rng, first_id=5, sentences=(2, 8), single_every=0):
    """Documents of random sentences whose token ids count up from first_id."""
    next_id = first_id
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        for d in range(n_docs):
            n_sent = 1 if single_every and d % single_every == 0 else int(rng.integers(*sentences))
            lens = rng.integers(3, 25, n_sent)
            ids = np.arange(next_id, next_id + lens.sum())
            next_id += int(lens.sum())
            w.add_document(ids, lens)
    assert next_id < N_WORDS + 5
    return prefix


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(str(tmp_path_factory.mktemp("corpus") / "c"), 300, np.random.default_rng(0))


def config(prefix, tmp_path, **kw):
    return DataConfig(data_path=[prefix] if isinstance(prefix, str) else prefix, seq_length=kw.pop("seq_length", 64),
                      split=kw.pop("split", "90,8,2"), data_cache_path=str(tmp_path / "cache"), **kw)


def build(prefix, tmp_path, tok, n=(500, 50, 10), binary_head=True, seed=7, **kw):
    return build_train_valid_test_datasets(config(prefix, tmp_path, **kw), tok, n, seed, binary_head)


def unmasked(sample):
    ids = sample["input_ids"].copy()
    at = sample["labels"] != IGNORE_INDEX
    ids[at] = sample["labels"][at]
    return ids


def test_sample_structure_and_sop(corpus, tmp_path, tok):
    train, valid, test = build(corpus, tmp_path, tok)
    assert len(train) >= 500 and len(valid) >= 50 and len(test) >= 10
    docs = IndexedDataset(corpus).document_indices
    sent_of_token = np.repeat(np.arange(len(IndexedDataset(corpus))), IndexedDataset(corpus).sequence_lengths)
    doc_of_sent = np.repeat(np.arange(len(docs) - 1), np.diff(docs))
    swapped = 0
    for i in range(200):
        s = train[i]
        assert {k: v.dtype for k, v in s.items()} == {k: np.int64 for k in s}
        n = int(s["attention_mask"].sum())
        assert s["attention_mask"][:n].all() and not s["attention_mask"][n:].any()
        ids, tt = unmasked(s), s["token_type_ids"]
        assert (ids[n:] == tok.pad).all() and ids[0] == tok.cls and ids[n - 1] == tok.sep
        seps = np.flatnonzero(ids[:n] == tok.sep)
        assert len(seps) == 2 and (tt[:seps[0] + 1] == 0).all() and (tt[seps[0] + 1:n] == 1).all()
        a, b = ids[1:seps[0]], ids[seps[0] + 1:n - 1]
        assert len(a) and len(b) and n <= 64
        for seg in (a, b):  # each segment is a contiguous run of the corpus
            assert (np.diff(seg) == 1).all()
        # A and B come from one document; in order for label 0 (next), swapped for label 1.
        assert doc_of_sent[sent_of_token[a[0] - 5]] == doc_of_sent[sent_of_token[b[0] - 5]]
        assert (a[0] > b[-1]) == bool(s["next_sentence_label"])
        swapped += int(s["next_sentence_label"])
    assert 70 < swapped < 130


def test_masking_statistics(corpus, tmp_path, tok):
    train, _, _ = build(corpus, tmp_path, tok, n=(3000, 0, 0), seq_length=128)
    chosen = maskable = as_mask = as_random = kept = capped = 0
    for i in range(3000):
        s = train[i]
        n = int(s["attention_mask"].sum())
        at = s["labels"] != IGNORE_INDEX
        assert not at[[0, n - 1]].any() and not at[n:].any()  # never [CLS], [SEP] or padding
        chosen += at.sum()
        maskable += n - 3
        capped += at.sum() <= round(0.15 * 128)
        got, orig = s["input_ids"][at], s["labels"][at]
        as_mask += (got == tok.mask).sum()
        kept += (got == orig).sum()
        as_random += ((got != orig) & (got != tok.mask)).sum()
        assert (got[(got != orig) & (got != tok.mask)] >= 5).all()  # random replacements are real tokens
    assert capped == 3000
    assert abs(chosen / maskable - 0.15) < 0.01
    assert abs(as_mask / chosen - 0.8) < 0.02
    assert abs(as_random / chosen - 0.1) < 0.015 and abs(kept / chosen - 0.1) < 0.015


def test_whole_word_masking(corpus, tmp_path, tok):
    train, _, _ = build(corpus, tmp_path, tok, n=(300, 0, 0), whole_word_masking=True)
    starts = tok.word_start_mask()
    for i in range(300):
        s = train[i]
        ids, at = unmasked(s), s["labels"] != IGNORE_INDEX
        n = int(s["attention_mask"].sum())
        assert at.sum() >= 1
        if round(0.15 * (n - 3)) < 3:
            continue  # shorter than this vocab's 3-piece words: masking.py masks part of one word instead
        for p in range(1, n - 1):
            # A continuation piece is masked exactly when the piece before it (same word) is.
            if not starts[ids[p]] and ids[p - 1] not in (tok.cls, tok.sep):
                assert at[p] == at[p - 1]


def test_nsp_takes_b_from_another_document(corpus, tmp_path, tok):
    train, _, _ = build(corpus, tmp_path, tok, n=(300, 0, 0), binary_head_task="nsp")
    ds = IndexedDataset(corpus)
    doc_of_token = np.repeat(np.repeat(np.arange(ds.num_documents), np.diff(ds.document_indices)),
                             ds.sequence_lengths)
    for i in range(300):
        s = train[i]
        ids = unmasked(s)
        seps = np.flatnonzero(ids == tok.sep)
        a, b = ids[1:seps[0]], ids[seps[0] + 1:seps[1]]
        same_doc = doc_of_token[a[0] - 5] == doc_of_token[b[0] - 5]
        assert same_doc != bool(s["next_sentence_label"])
        assert a[-1] < b[0] or not same_doc  # a real next segment follows A


def test_no_binary_head(corpus, tmp_path, tok):
    train, _, _ = build(corpus, tmp_path, tok, n=(100, 0, 0), binary_head=False)
    for i in range(100):
        s = train[i]
        n = int(s["attention_mask"].sum())
        assert (unmasked(s)[:n] == tok.sep).sum() == 1 and not s["token_type_ids"].any()
        assert s["next_sentence_label"] == 0


def _loader_batches(ds, consumed, mbs, dp_size, workers, steps):
    """Global batches of `steps` steps, each the concatenation of every DP rank's micro-batch."""
    loaders = [iter(build_pretraining_data_loader(ds, consumed, mbs, r, dp_size, workers)) for r in range(dp_size)]
    out = []
    for _ in range(steps):
        parts = [next(it) for it in loaders]
        out.append({k: torch.cat([p[k] for p in parts]) for k in parts[0]})
    return out


def test_same_sample_across_runs_workers_dp_sizes_and_resume(corpus, tmp_path, tok):
    train, _, _ = build(corpus, tmp_path, tok, n=(200, 0, 0))
    train_again, _, _ = build(corpus, tmp_path, tok, n=(200, 0, 0))  # a second run: from the cache
    for i in (0, 17, 199):
        for k, v in train[i].items():
            np.testing.assert_array_equal(v, train_again[i][k])
    base = _loader_batches(train, 0, 4, 1, 0, 6)  # global batch 4
    assert all(v.dtype == torch.int64 for v in base[0].values()) and base[0]["input_ids"].shape == (4, 64)
    np.testing.assert_array_equal(base[0]["input_ids"][1].numpy(), train[1]["input_ids"])
    for mbs, dp, workers in [(2, 2, 0), (1, 4, 0), (4, 1, 2), (2, 2, 2)]:
        other = _loader_batches(train, 0, mbs, dp, workers, 6)
        for x, y in zip(base, other):
            for k in x:
                assert torch.equal(x[k], y[k]), (mbs, dp, workers, k)
    resumed = _loader_batches(train, 3 * 4, 2, 2, 0, 3)  # resume after 3 steps with another layout
    assert len(resumed) == len(base[3:]) > 0
    for x, y in zip(base[3:], resumed):
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
    with pytest.raises(DataError, match="consumed samples"):
        build_pretraining_data_loader(train, len(train), 4, 0, 1, 0)


def test_mapping_cache_keyed_by_inputs(corpus, tmp_path, tok):
    build(corpus, tmp_path, tok, n=(100, 0, 0))
    files = sorted(os.listdir(tmp_path / "cache"))
    assert len([f for f in files if f.endswith(".npy")]) == 1 and not any(f.endswith("tmp") for f in files)
    build(corpus, tmp_path, tok, n=(100, 0, 0))
    assert sorted(os.listdir(tmp_path / "cache")) == files
    build(corpus, tmp_path, tok, n=(100, 0, 0), seed=8)
    build(corpus, tmp_path, tok, n=(100, 0, 0), seq_length=32)
    assert len([f for f in os.listdir(tmp_path / "cache") if f.endswith(".npy")]) == 3


def test_blend_follows_weights(tmp_path, tok):
    rng = np.random.default_rng(3)
    a = write_corpus(str(tmp_path / "a"), 60, rng, first_id=5)
    b = write_corpus(str(tmp_path / "b"), 60, rng, first_id=15000)
    train, valid, _ = build(["0.3", a, "0.7", b], tmp_path, tok, n=(1000, 40, 0))
    from_b = np.array([unmasked(train[i])[1] >= 15000 for i in range(1000)])
    assert abs(from_b.mean() - 0.7) < 0.002 and abs(from_b[:100].mean() - 0.7) < 0.02
    assert len(train) == 1000 and len(valid) == 40


def test_one_sentence_documents_warned_and_skipped(tmp_path, tok):
    prefix = write_corpus(str(tmp_path / "s"), 100, np.random.default_rng(4), single_every=4)
    with pytest.warns(DataWarning, match="23 of 90 documents in the train split .* single sentence"):
        train, _, _ = build(prefix, tmp_path, tok, n=(200, 0, 0))
    assert len(train) >= 200
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # without the binary head nothing is skipped
        build(prefix, tmp_path, tok, n=(200, 0, 0), binary_head=False)


def test_no_pair_anywhere_is_an_error_not_a_hang(tmp_path, tok):
    prefix = write_corpus(str(tmp_path / "one"), 50, np.random.default_rng(5), sentences=(1, 2))
    with pytest.raises(DataError, match="train split .* none of its documents has two sentences.*--split-sentences"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            build(prefix, tmp_path, tok, n=(10 ** 9, 0, 0))


def test_held_out_split_without_documents_is_a_warning_train_an_error(corpus, tmp_path, tok, caplog):
    """As Megatron: a valid or test share that rounds to no document of a small corpus leaves that
    split out (pretrain_bert.py reads no test split; --split 969,30,1 gives 300 documents none)."""
    with caplog.at_level("WARNING", logger="megabert"):
        assert build(corpus, tmp_path, tok, split="99.9,0.09,0.01", n=(10, 10, 10))[1:] == (None, None)
    lines = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(lines) == 2 and "the valid split of --data-path holds no document (--split 99.9,0.09,0.01 of 300 " \
        "documents): no valid split, no evaluation" in lines[0] and "the test split" in lines[1], lines
    assert build(corpus, tmp_path, tok, split="100,0,0", n=(10, 10, 10))[1:] == (None, None)
    with pytest.raises(DataError, match=r"train split .* \(documents 0..0 of 300.*holds no document.*--split"):
        build(corpus, tmp_path, tok, split="0.01,99.99,0", n=(10, 10, 10))


def test_mapping_rows_are_sentence_runs_of_one_document(corpus):
    ds = IndexedDataset(corpus)
    docs = ds.document_indices
    mapping, stats = build_mapping(ds, (0, ds.num_documents), 5000, 61, 0.1, 1, 2)
    assert len(mapping) >= 5000 and stats["epochs"] >= 2
    doc_first = np.searchsorted(docs, mapping[:, 0], side="right") - 1
    doc_last = np.searchsorted(docs, mapping[:, 1] - 1, side="right") - 1
    assert (doc_first == doc_last).all() and (mapping[:, 1] - mapping[:, 0] >= 2).all()
    assert (mapping[:, 2] >= 2).all() and (mapping[:, 2] <= 61).all() and (mapping[:, 2] < 61).mean() > 0.05
    one_epoch, _ = build_mapping(ds, (0, ds.num_documents), None, 61, 0.1, 1, 2)
    used = np.zeros(len(ds), int)
    for first, end, _ in one_epoch:
        used[first:end] += 1
    multi = np.diff(docs) >= 2
    assert (used[np.repeat(multi, np.diff(docs))] == 1).all()  # one epoch covers every pairable sentence once


@pytest.mark.parametrize("la,lb,budget", [(10, 3, 8), (3, 10, 8), (6, 6, 5), (7, 6, 4), (5, 5, 20), (9, 2, 1)])
def test_truncate_pair_matches_megatron_loop(la, lb, budget):
    a, b = np.arange(la), np.arange(100, 100 + lb)
    ta, tb = truncate_pair(a, b, budget, np.random.default_rng(0))
    ra, rb = la, lb  # Megatron: remove from the longer (B on a tie) until the pair fits
    while ra + rb > budget:
        if ra > rb:
            ra -= 1
        else:
            rb -= 1
    assert (len(ta), len(tb)) == (ra, rb)
    assert (np.diff(ta) == 1).all() and (np.diff(tb) == 1).all()


def _dp_worker(rank, world_size, prefix, vocab, cache, out_dir):
    """Each data-parallel rank builds the datasets (racing on one cache dir) and reads its slices."""
    import torch.distributed as dist

    tok = build_tokenizer("BertWordPieceLowerCase", vocab)
    cfg = DataConfig(data_path=[prefix], seq_length=64, split="90,8,2", data_cache_path=cache)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DataWarning)
        train, _, _ = build_train_valid_test_datasets(cfg, tok, (64, 0, 0), 7, True)
    loader = iter(build_pretraining_data_loader(train, 8, 2, rank, world_size, 1))
    mine = torch.stack([next(loader)["input_ids"] for _ in range(3)])  # [steps, micro_batch, seq]
    gathered = [torch.zeros_like(mine) for _ in range(world_size)]
    dist.all_gather(gathered, mine)
    if rank == 0:
        torch.save(torch.cat(gathered, dim=1), os.path.join(out_dir, "global.pt"))  # [steps, global, seq]


def test_real_data_parallel_ranks_see_the_single_process_order(corpus, vocab, tok, tmp_path):
    from tests.helpers.dist_utils import run_distributed

    run_distributed(_dp_worker, 2, corpus, vocab, str(tmp_path / "cache"), str(tmp_path))
    got = torch.load(tmp_path / "global.pt", weights_only=True)
    train, _, _ = build(corpus, tmp_path, tok, n=(64, 0, 0))
    expected = torch.stack([torch.from_numpy(np.stack([train[8 + 4 * s + i]["input_ids"] for i in range(4)]))
                            for s in range(3)])
    assert torch.equal(got, expected)


@pytest.mark.parametrize("data_path,words", [([], "required"), (["0.3", "A", "B"], "weight/prefix pairs"),
                                             (["A", "B"], "weight/prefix pairs"), (["0", "A", "0", "B"], "positive")])
def test_data_path_errors(data_path, words):
    from megabert.tasks.pretraining.indexed_splits import parse_data_path
    from megabert.errors import ConfigError

    with pytest.raises(ConfigError, match=words):
        parse_data_path(data_path)
    assert parse_data_path(["1", "A.bin", "3", "B"]) == (["A", "B"], [0.25, 0.75])
