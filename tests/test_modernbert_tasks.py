"""ModernBERT's fine-tuning heads and its byte-level BPE tokenizer in the tasks:
- ModernBertForQuestionAnswering and ModernBertForTokenClassification equal transformers' classes
  loaded from the same directory (logits, loss, every gradient; fp32; TP 1 and 2), and from a
  masked-LM directory they take its prediction head as transformers does;
- sequence classification pools packed rows per sample ([CLS] or mean, as classifier_pooling);
- finetune_squad.py and finetune_ner.py fine-tune a ModernBERT --load (a transformers dir with a
  byte-level BPE tokenizer.json): SQuAD's character offsets and NER's first sub-words line up
  with the `tokenizers` library's offsets, the run finishes, its loss falls, and the fine-tuned
  model exports to transformers' class (labels included) with the same logits;
- whole-word masking on byte-level BPE: the first word of every sentence starts a word, the
  pieces inside a word do not."""
import json
import os
import random

import numpy as np
import pytest
import torch

import megabert
from megabert.data.packing import PackingSpec, pack_window
from megabert.tasks.ner.data import read_sentences

from tests.helpers.cli_utils import run_main
from tests.helpers.dist_utils import run_distributed
from tests.helpers.hf_models import close
from tests.helpers.modernbert_models import make_modernbert_dir, modernbert_batch
from tests.helpers.ner_files import conll, tagged_sentences, write
from tests.helpers.squad_demo import DEMO

transformers = pytest.importorskip("transformers")

SPECIALS = ["[PAD]", "[CLS]", "[SEP]", "[MASK]", "[UNK]"]  # ids 0-4: pad 0, cls 1, sep 2 as the config says
BPE_VOCAB = 512  # the 256 byte symbols, the specials and some merges


def save_byte_level_tokenizer(path, texts, vocab_size=BPE_VOCAB):
    """A byte-level BPE tokenizer.json as ModernBERT's is made (ByteLevel pre-tokenizer and
    decoder, no prefix space, [CLS] $A [SEP] added by its post-processor), trained on `texts`,
    saved as transformers saves it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]",
                                                       special_tokens=[("[CLS]", 1), ("[SEP]", 2)])
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", cls_token="[CLS]",
                                                sep_token="[SEP]", mask_token="[MASK]", unk_token="[UNK]")
    fast.save_pretrained(str(path))
    return os.path.join(str(path), "tokenizer.json")


# ------------------------------------------------------------------ the heads vs transformers


def _check_head(rank, world, hf_dir, arch, unpad):
    ps = megabert.init_parallel(tensor_parallel_size=world)
    hf = getattr(transformers, arch).from_pretrained(hf_dir, attn_implementation="eager")
    ids, am, _ = modernbert_batch()
    if arch == "ModernBertForQuestionAnswering":
        targets = dict(start_positions=torch.tensor([3, 9, 1]), end_positions=torch.tensor([5, 12, 4]))
        # The span loss's softmax runs over every position, padding too (transformers'), and
        # padding positions' logits mean nothing (see tests/test_modernbert.py: a local layer's
        # padding query may have no real key; the unpadded encoder leaves padding zero): the
        # loss is compared on full rows (of real tokens: transformers' embedding gives its
        # padding id no gradient). The token classifier below takes padded rows.
        ids, am = torch.where(am == 0, 5, ids), torch.ones_like(am)
    else:
        labels = torch.randint(0, 5, ids.shape, generator=torch.Generator().manual_seed(0))
        labels[am == 0] = -100
        labels[:, 0] = -100
        targets = dict(labels=labels)
    ref = hf(input_ids=ids, attention_mask=am, **targets)
    ref.loss.backward()
    model = getattr(megabert, arch).from_pretrained(hf_dir, ps, attention_backend="varlen" if unpad else "torch",
                                                    unpad_input=unpad, **({"num_labels": 5} if "labels" in targets
                                                                          else {}))
    out = model(ids, attention_mask=am, **targets)
    out.loss.backward()
    real = am.bool()  # padding positions' logits mean nothing (see tests/test_modernbert.py)
    names = ("start_logits", "end_logits") if "labels" not in targets else ("logits",)
    for name in names:
        close(getattr(out, name)[real], getattr(ref, name)[real], name)
    close(out.loss, ref.loss, "loss")
    from tests.test_modernbert import _close_grads

    hf_grads = _close_grads(model, ps, hf)
    assert set(hf_grads) == {n for n, _ in hf.named_parameters()}


@pytest.mark.parametrize("arch", ["ModernBertForQuestionAnswering", "ModernBertForTokenClassification"])
@pytest.mark.parametrize("world,unpad", [(1, True), (2, False)])
def test_heads_equal_transformers(tmp_path, arch, world, unpad):
    extra = {"num_labels": 5} if arch == "ModernBertForTokenClassification" else {}
    hf_dir = make_modernbert_dir(tmp_path / "hf", arch, classifier_bias=True, **extra)
    run_distributed(_check_head, world, hf_dir, arch, unpad)


@pytest.mark.parametrize("arch", ["ModernBertForQuestionAnswering", "ModernBertForTokenClassification"])
def test_heads_from_a_masked_lm_take_its_prediction_head(tmp_path, arch):
    """From a ModernBertForMaskedLM dir the task head's dense and norm are the MLM head's (as
    transformers loads them) and only the classifier is new: with transformers' classifier
    copied in, the logits are transformers'."""
    hf_dir = make_modernbert_dir(tmp_path / "hf")
    megabert.init_parallel()
    model = getattr(megabert, arch).from_pretrained(hf_dir, attention_backend="torch")
    hf = getattr(transformers, arch).from_pretrained(hf_dir, attn_implementation="eager")
    with torch.no_grad():
        hf.classifier.weight.copy_(model.classifier.weight)
        hf.classifier.bias.copy_(model.classifier.bias)
    mlm = transformers.ModernBertForMaskedLM.from_pretrained(hf_dir)
    assert torch.equal(model.prediction_head.dense.weight, mlm.head.dense.weight)
    ids, am, _ = modernbert_batch()
    with torch.no_grad():
        out, ref = model(ids, attention_mask=am), hf(input_ids=ids, attention_mask=am)
    name = "logits" if hasattr(ref, "logits") else "start_logits"
    close(getattr(out, name)[am.bool()], getattr(ref, name)[am.bool()], name)


@pytest.mark.parametrize("arch", ["ModernBertForQuestionAnswering", "ModernBertForTokenClassification"])
def test_convert_hf_imports_the_task_heads(tmp_path, arch):
    """convert_hf.py import of a transformers ModernBERT task dir keeps its head (and a tagger's
    labels): the megabert checkpoint gives transformers' logits."""
    labels = {"id2label": {0: "O", 1: "B-PER", 2: "I-PER"}} if "Token" in arch else {}
    hf_dir = make_modernbert_dir(tmp_path / "hf", arch, classifier_bias=True, **labels)
    r = run_main("tools/checkpoint/convert_hf.py", "import", "--hf-dir", hf_dir, "--output", str(tmp_path / "ckpt"))
    assert r.returncode == 0, r.stderr[-3000:]
    hf = getattr(transformers, arch).from_pretrained(hf_dir, attn_implementation="eager").eval()
    _same_logits(tmp_path / "ckpt", hf, *(("logits",) if labels else ("start_logits", "end_logits")), vocab=99)
    if labels:
        assert megabert.ModernBertForTokenClassification.from_pretrained(str(tmp_path / "ckpt")).config.id2label \
            == labels["id2label"]


# ------------------------------------------------------------------ packed rows, per sample

SEQ, CAP = 24, 3


def _packed_samples():
    ids, am, _ = modernbert_batch()
    g = torch.Generator().manual_seed(5)
    samples = []
    for i in range(6):
        n = int(am[i % 3].sum()) if i < 3 else int(torch.randint(4, 12, (1,), generator=g))
        row = torch.zeros(SEQ, dtype=torch.long)
        row[:n] = ids[i % 3, :n] if i < 3 else torch.randint(3, 99, (n,), generator=g)
        row[0] = 1
        samples.append({"input_ids": row.numpy(), "token_type_ids": np.zeros(SEQ, np.int64),
                        "attention_mask": (torch.arange(SEQ) < n).long().numpy(), "labels": np.array(i % 3)})
    return samples


@pytest.mark.parametrize("pooling,backend,unpad", [("cls", "varlen", True), ("mean", "torch", False),
                                                   ("mean", "sdpa", True)])
def test_sequence_classification_pools_each_packed_sample(pooling, backend, unpad):
    """A packed row's slots get the logits of their samples run alone, [CLS] or mean pooling,
    and the loss leaves empty slots out."""
    megabert.init_parallel()
    cfg = megabert.modernbert_tiny(num_layers=3, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48,
                                   vocab_size=99, max_position_embeddings=64, local_attention=8, num_labels=3,
                                   classifier_pooling=pooling, attention_backend=backend, unpad_input=unpad)
    model = megabert.ModernBertForSequenceClassification(cfg, seed=2).eval()
    samples = _packed_samples()
    spec = PackingSpec(seq_length=SEQ, max_samples_per_row=CAP, window=len(samples), seed=1, sample_fields=("labels",))
    w = pack_window(samples, 0, spec)
    batch = {k: torch.from_numpy(v) for k, v in w.items() if k != "row_samples"}
    with torch.no_grad():
        packed = model(**batch)
        alone = model(torch.from_numpy(np.stack([s["input_ids"] for s in samples])),
                      attention_mask=torch.from_numpy(np.stack([s["attention_mask"] for s in samples])),
                      labels=torch.tensor([int(s["labels"]) for s in samples]))
    slots = w["packed_seqlens"].reshape(-1) > 0
    assert int(slots.sum()) == len(samples)
    got = packed.logits[torch.from_numpy(slots)]
    # Each slot's sample, found by its tokens (rows keep the stream's order within a row).
    for k, (r, c) in enumerate(zip(*np.nonzero(w["packed_seqlens"]))):
        start = int(w["packed_seqlens"][r, :c].sum())
        n = int(w["packed_seqlens"][r, c])
        i = next(i for i, s in enumerate(samples) if int(s["attention_mask"].sum()) == n
                 and np.array_equal(s["input_ids"][:n], w["input_ids"][r, start:start + n]))
        torch.testing.assert_close(got[k], alone.logits[i], atol=1e-5, rtol=0)
    torch.testing.assert_close(packed.loss, alone.loss, atol=1e-5, rtol=0)


@pytest.mark.parametrize("backend,unpad", [("varlen", True), ("torch", False)])
def test_token_classification_tags_each_packed_sample(backend, unpad):
    """NER's packed rows (--pack-sequences): every real token's tag logits equal its sample's alone."""
    megabert.init_parallel()
    cfg = megabert.modernbert_tiny(num_layers=3, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48,
                                   vocab_size=99, max_position_embeddings=64, local_attention=8, num_labels=5,
                                   attention_backend=backend, unpad_input=unpad)
    model = megabert.ModernBertForTokenClassification(cfg, seed=2).eval()
    samples = [{k: v for k, v in s.items() if k != "labels"} for s in _packed_samples()]
    w = pack_window(samples, 0, PackingSpec(seq_length=SEQ, max_samples_per_row=CAP, window=len(samples), seed=1))
    batch = {k: torch.from_numpy(v) for k, v in w.items() if k != "row_samples"}
    with torch.no_grad():
        packed = model(**batch).logits
        alone = model(torch.from_numpy(np.stack([s["input_ids"] for s in samples])),
                      attention_mask=torch.from_numpy(np.stack([s["attention_mask"] for s in samples]))).logits
    for r, c in zip(*np.nonzero(w["packed_seqlens"])):
        start, n = int(w["packed_seqlens"][r, :c].sum()), int(w["packed_seqlens"][r, c])
        i = next(i for i, s in enumerate(samples) if int(s["attention_mask"].sum()) == n
                 and np.array_equal(s["input_ids"][:n], w["input_ids"][r, start:start + n]))
        torch.testing.assert_close(packed[r, start:start + n], alone[i, :n], atol=1e-5, rtol=0)


# ------------------------------------------------------------------ fine-tuning runs on a ModernBERT --load


def _squad_texts():
    data = json.load(open(os.path.join(DEMO, "train.json")))["data"]
    return [t for a in data for p in a["paragraphs"] for t in [p["context"]] + [q["question"] for q in p["qas"]]]


@pytest.fixture(scope="module")
def squad_modernbert(tmp_path_factory):
    """A transformers ModernBERT (masked LM, no dropout) with a byte-level BPE tokenizer.json
    trained on the SQuAD demo set."""
    d = tmp_path_factory.mktemp("mb_squad") / "hf"
    make_modernbert_dir(d, vocab_size=BPE_VOCAB, max_position_embeddings=128)
    save_byte_level_tokenizer(d, _squad_texts())
    return str(d)


def test_squad_offsets_follow_the_byte_level_tokens(squad_modernbert):
    """Every training answer maps to the tokens whose trimmed character spans cover it exactly
    (the `tokenizers` library's offsets, the leading space of a Ġ token left out)."""
    from megabert.data.tokenizers import HuggingFaceTokenizer
    from megabert.tasks.squad.examples import read_squad_examples
    from megabert.tasks.squad.features import convert_examples_to_features

    tok = HuggingFaceTokenizer(squad_modernbert)
    examples = read_squad_examples(os.path.join(DEMO, "train.json"), is_training=True)
    feats = convert_examples_to_features(examples, tok, max_seq_length=128, doc_stride=32, max_query_length=32,
                                         is_training=True)
    answered = [f for f in feats if f.start_position > 0]
    assert len({f.example_index for f in answered}) == len(examples)  # every answer lies in some window
    exact = 0
    for f in answered:
        ex = examples[f.example_index]
        a, b = f.offsets[f.start_position][0], f.offsets[f.end_position][1]
        start, end = ex.answer_span
        assert ex.context[a:b].strip() == ex.context[a:b]  # no whitespace taken into the span
        assert a <= start and end <= b, (ex.context[a:b], ex.answers[0])
        # Tight: the first and the last token hold answer characters.
        assert f.offsets[f.start_position][1] > start and f.offsets[f.end_position][0] < end
        exact += ex.context[a:b] == ex.answers[0][0]
    assert exact >= 0.9 * len(answered)  # byte-level pieces mostly split where answers do


def _losses(path, key):
    return [json.loads(line)[key] for line in open(path) if key in line]


def test_finetune_squad_on_a_modernbert(squad_modernbert, tmp_path):
    out, metrics = tmp_path / "out", tmp_path / "m.jsonl"
    r = run_main("finetune_squad.py", "--load", squad_modernbert, "--train-file", os.path.join(DEMO, "train.json"),
                 "--predict-file", os.path.join(DEMO, "dev.json"), "--output-dir", str(out), "--max-seq-length",
                 "128", "--doc-stride", "32", "--max-query-length", "32", "--micro-batch-size", "8",
                 "--global-batch-size", "8", "--train-iters", "30", "--lr", "2e-3", "--seed", "3", "--log-interval",
                 "1", "--metrics-file", str(metrics), "--save", str(tmp_path / "ckpt"))
    assert r.returncode == 0, r.stderr[-3000:]
    losses = _losses(metrics, "qa_loss")
    assert len(losses) == 30
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.5, losses
    results = json.load(open(out / "eval_results.json"))
    assert set(results) >= {"exact_match", "f1"}
    predictions = json.load(open(out / "predictions.json"))
    assert predictions and all(p == p.strip() for p in predictions.values())  # spans from trimmed offsets
    # The fine-tuned model exports to transformers' ModernBertForQuestionAnswering, which scores
    # spans as megabert does.
    hf = _export(tmp_path / "ckpt", tmp_path / "hf", "ModernBertForQuestionAnswering")
    _same_logits(tmp_path / "ckpt", hf, "start_logits", "end_logits")


@pytest.fixture(scope="module")
def ner_modernbert(tmp_path_factory):
    d = tmp_path_factory.mktemp("mb_ner")
    rng = random.Random(3)
    train = write(d / "train.txt", conll(tagged_sentences(rng, 48, longest=12)))
    dev = write(d / "dev.txt", conll(tagged_sentences(rng, 16, longest=12)))
    texts = [" ".join(s.words) for s in tagged_sentences(random.Random(9), 200, longest=12)]
    make_modernbert_dir(d / "hf", vocab_size=BPE_VOCAB)
    save_byte_level_tokenizer(d / "hf", texts)
    return str(d / "hf"), train, dev


def test_ner_first_sub_words_follow_the_tokenizers_offsets(ner_modernbert):
    """Each word's labelled position is the token where the `tokenizers` library's offsets of
    the sentence put the word's first character, and the sentence's tokens are its tokens."""
    from megabert.data.tokenizers import HuggingFaceTokenizer
    from megabert.tasks.ner.data import read_sentences
    from megabert.tasks.ner.features import sentences_to_features

    hf_dir, train, _ = ner_modernbert
    tok = HuggingFaceTokenizer(hf_dir)
    sentences = read_sentences(train, labelled=True)
    label2id = {t: i for i, t in enumerate(sorted({t for s in sentences for t in s.tags}))}
    feats = sentences_to_features(sentences, tok, 64, label2id=label2id)
    for f, window in enumerate(feats.windows):
        s = sentences[window.sentence]
        text = "".join(" " + w for w in s.words)  # each word after a space, as in running text
        ids, offsets = tok.encode_with_offsets(text)
        starts, pos = [], 0
        for w in s.words:
            pos = text.index(w, pos)
            starts.append(pos)
            pos += len(w)
        first = [next(k for k, (a, b) in enumerate(offsets) if a <= c < b) for c in starts]
        assert feats.tensors["input_ids"][f, 1:1 + len(ids)].tolist() == ids
        labels = feats.tensors["labels"][f]
        assert [p for p, _ in window.owned] == [1 + k for k in first]
        assert (labels != -100).nonzero().squeeze(1).tolist() == [1 + k for k in first]


def test_finetune_ner_on_a_modernbert(ner_modernbert, tmp_path):
    hf_dir, train, dev = ner_modernbert
    out, metrics = tmp_path / "out", tmp_path / "m.jsonl"
    r = run_main("finetune_ner.py", "--load", hf_dir, "--train-file", train, "--validation-file", dev,
                 "--output-dir", str(out), "--max-seq-length", "64", "--micro-batch-size", "8",
                 "--global-batch-size", "8", "--train-iters", "24", "--lr", "3e-3", "--seed", "3", "--log-interval",
                 "1", "--metrics-file", str(metrics), "--save", str(tmp_path / "ckpt"))
    assert r.returncode == 0, r.stderr[-3000:]
    losses = _losses(metrics, "ner_loss")
    assert len(losses) == 24
    assert np.mean(losses[-4:]) < np.mean(losses[:4]) - 0.3, losses
    results = json.load(open(out / "eval_results.json"))
    assert 0 <= results["eval_f1"] <= 1 and results["eval_accuracy"] > 0.5
    hf = _export(tmp_path / "ckpt", tmp_path / "hf", "ModernBertForTokenClassification")
    assert sorted(hf.config.id2label.values()) == sorted({t for s in read_sentences(train) for t in s.tags})
    _same_logits(tmp_path / "ckpt", hf, "logits")


def _export(ckpt, hf_dir, arch):
    r = run_main("tools/checkpoint/convert_hf.py", "export", "--load", str(ckpt), "--hf-dir", str(hf_dir))
    assert r.returncode == 0, r.stderr[-3000:]
    hf = getattr(transformers, f"AutoModelFor{'QuestionAnswering' if 'Question' in arch else 'TokenClassification'}"
                 ).from_pretrained(hf_dir, attn_implementation="eager").eval()
    assert type(hf).__name__ == arch
    return hf


def _same_logits(ckpt, hf, *names, vocab=BPE_VOCAB):
    """megabert's model from the checkpoint and transformers' give the same logits on real tokens."""
    megabert.init_parallel()
    model = getattr(megabert, type(hf).__name__).from_pretrained(str(ckpt), attention_backend="torch").eval()
    ids = torch.randint(5, vocab, (2, 40), generator=torch.Generator().manual_seed(0))
    am = torch.ones_like(ids)
    am[1, 30:] = 0
    with torch.no_grad():
        ours, ref = model(ids, attention_mask=am), hf(input_ids=ids, attention_mask=am)
    for name in names:
        close(getattr(ours, name)[am.bool()], getattr(ref, name)[am.bool()], name)


# ------------------------------------------------------------------ whole-word masking on byte-level BPE


@pytest.fixture(scope="module")
def byte_level_tokenizer(tmp_path_factory):
    """A small byte-level BPE (few merges: most words are several pieces) trained on the SQuAD
    demo's sentences, and the sentences."""
    from megabert.data.tokenizers import HuggingFaceTokenizer

    sentences = [s.strip().rstrip(".") + "." for t in _squad_texts() for s in t.split(". ") if len(s.strip()) > 3]
    d = tmp_path_factory.mktemp("bpe")
    save_byte_level_tokenizer(d, sentences, vocab_size=320)
    return HuggingFaceTokenizer(str(d)), sentences


def _true_word_starts(tok, text: str) -> list[bool]:
    """The truth from the `tokenizers` library: a piece begins a word when its span begins one
    of the byte-level pre-tokenizer's words (which no BPE piece crosses; a word takes the space
    before it, so a lone "Ġ" piece begins the word after it)."""
    from tokenizers import Tokenizer

    backend = Tokenizer.from_file(tok.source if tok.source.endswith(".json")
                                  else os.path.join(tok.source, "tokenizer.json"))
    starts = {a for _, (a, _) in backend.pre_tokenizer.pre_tokenize_str(text)}
    return [a in starts for a, _ in backend.encode(text, add_special_tokens=False).offsets]


def test_word_starts_of_byte_level_sentences(byte_level_tokenizer):
    """Sentences tokenized one by one (preprocess_data.py --split-sentences) and framed as a
    sample: the first word of every sentence (no "Ġ") starts a word, and so does every piece
    that begins a word of the pre-tokenizer; the pieces inside a word do not."""
    tok, sentences = byte_level_tokenizer
    rule = tok.word_starts()
    old = tok.word_start_mask()  # the context-free rule alone: a piece begins a word where it has a "Ġ"
    checked = continuations = first_without_g = 0
    for k in range(0, 60, 3):
        group = sentences[k:k + 3]
        ids = [tok.cls] + [t for s in group for t in tok.tokenize(s)] + [tok.sep]
        got = rule(np.asarray(ids[1:-1]))
        want = [w for s in group for w in _true_word_starts(tok, s)]
        assert got.tolist() == want, group
        at = 0
        for s in group:
            n = len(tok.tokenize(s))
            assert got[at], s  # every sentence's first word
            first_without_g += not old[ids[1 + at]]
            at += n
        checked += len(want)
        continuations += want.count(False)
    assert first_without_g >= 10  # sentence-initial pieces carry no "Ġ": the old rule missed them
    assert continuations > 0.2 * checked  # the vocab is small: many words are several pieces


def test_word_starts_after_a_newline_and_inside_numbers(byte_level_tokenizer):
    tok, _ = byte_level_tokenizer
    text = "Results\nThe json module was released in 2008 (version 2.6), as json.dumps shows."
    got = tok.word_starts()(np.asarray(tok.tokenize(text)))
    assert got.tolist() == _true_word_starts(tok, text)
    pieces = [tok.inv_vocab[i] for i in tok.tokenize(text)]
    assert pieces[pieces.index("Ċ") + 1] == "The" or pieces[pieces.index("Ċ") + 1].startswith("T")


def test_whole_word_masking_masks_byte_level_words_whole(byte_level_tokenizer):
    """mask_tokens with the rule: a piece is masked exactly when the first piece of its word is,
    words counted as the pre-tokenizer counts them."""
    from megabert.tasks.pretraining.masking import IGNORE_INDEX, mask_tokens

    tok, sentences = byte_level_tokenizer
    rule = tok.word_starts()
    rng = np.random.default_rng(0)
    for k in range(0, 40, 2):
        ids = np.asarray([tok.cls] + [t for s in sentences[k:k + 2] for t in tok.tokenize(s)] + [tok.sep])
        maskable = np.ones(len(ids), dtype=bool)
        maskable[[0, -1]] = False
        _, labels = mask_tokens(ids, maskable, rng, mask_prob=0.3, max_predictions=len(ids), mask_id=tok.mask,
                                random_ids=np.arange(5, 300), word_start=rule)
        at = labels != IGNORE_INDEX
        starts = [w for s in sentences[k:k + 2] for w in _true_word_starts(tok, s)]
        for p in range(2, len(ids) - 1):
            if not starts[p - 1]:  # p is inside a word: masked with the piece before it
                assert at[p] == at[p - 1]


def test_whole_word_masking_needs_word_marks(tmp_path):
    """A BPE whose pieces mark no word (a whitespace pre-tokenizer, no prefix or suffix) cannot
    say where words start: a one-line error, not a silent all-one-word rule."""
    from megabert.data.tokenizers import HuggingFaceTokenizer
    from megabert.errors import ConfigError
    from tests.helpers.modernbert_models import save_tokenizer

    save_tokenizer(tmp_path, ["the quick brown fox jumps over the lazy dog"] * 5)
    with pytest.raises(ConfigError, match="whole-word-masking"):
        HuggingFaceTokenizer(str(tmp_path)).word_starts()
