"""ModernBERT in and out of Hugging Face: convert_hf.py import (any layout) and export (loads in
transformers' ModernBertForMaskedLM and AutoTokenizer as it stands); pretrain_bert.py --load of a
transformers ModernBERT dir (architecture from its config.json; first-step loss equals
transformers' on the same batch) and --model-family modernbert from scratch."""
import json
import os

import pytest
import torch

import megabert
from megabert.arguments import parse_args
from megabert.errors import CheckpointError, ConfigError

from tests.conftest import _corpus
from tests.helpers.cli_utils import run_main
from tests.helpers.hf_models import close
from tests.helpers.modernbert_models import make_modernbert_dir, modernbert_batch, save_tokenizer

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A transformers ModernBERT dir with its tokenizer.json, and a corpus preprocessed with it."""
    d = tmp_path_factory.mktemp("modernbert_ckpt")
    hf_dir = make_modernbert_dir(d / "hf")
    _corpus(d / "corpus.jsonl", docs=60)
    with open(d / "corpus.jsonl") as f:
        save_tokenizer(hf_dir, [json.loads(line)["text"] for line in f])
    r = run_main("tools/preprocess_data.py", "--input", str(d / "corpus.jsonl"), "--output-prefix", str(d / "c"),
                 "--json-keys", "text", "--tokenizer-type", "HuggingFaceTokenizer", "--vocab-file",
                 os.path.join(hf_dir, "tokenizer.json"), "--split-sentences", "--workers", "1")
    assert r.returncode == 0, r.stderr
    return d, hf_dir


def _logits(model_dir):
    model = transformers.ModernBertForMaskedLM.from_pretrained(model_dir, attn_implementation="eager")
    ids, am, _ = modernbert_batch()
    return model(input_ids=ids, attention_mask=am).logits, model


def test_import_export_round_trip(setup, tmp_path):
    """HF -> megabert at TP 2 x PP 2 -> HF: every tensor and the config's facts come back,
    transformers loads the export (model and tokenizer) as it stands, and megabert reads the
    converted checkpoint at TP 1 with transformers' logits."""
    _, hf_dir = setup
    ckpt, out = tmp_path / "ckpt", tmp_path / "export"
    r = run_main("tools/checkpoint/convert_hf.py", "import", "--hf-dir", hf_dir, "--output", str(ckpt),
                 "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2")
    assert r.returncode == 0, r.stderr
    assert os.path.isfile(ckpt / "tokenizer.json")
    r = run_main("tools/checkpoint/convert_hf.py", "export", "--load", str(ckpt), "--hf-dir", str(out))
    assert r.returncode == 0, r.stderr
    written = r.stdout.strip().splitlines()[-1].split(": ", 1)[1].split(", ")  # the files it says it wrote
    assert "tokenizer.json" in written and "vocab.txt" not in written
    assert sorted(written) == sorted(os.listdir(out)), (written, os.listdir(out))

    ref_logits, ref = _logits(hf_dir)
    logits, exported = _logits(str(out))
    assert torch.equal(logits, ref_logits)
    ours, theirs = exported.state_dict(), ref.state_dict()
    assert set(ours) == set(theirs)
    for k in theirs:
        assert torch.equal(ours[k], theirs[k]), k
    for key in ("layer_types", "rope_parameters", "local_attention", "norm_bias", "norm_eps", "decoder_bias",
                "pad_token_id", "cls_token_id", "sep_token_id", "vocab_size", "tie_word_embeddings"):
        assert getattr(exported.config, key) == getattr(ref.config, key), key
    tok, ref_tok = transformers.AutoTokenizer.from_pretrained(str(out)), transformers.AutoTokenizer.from_pretrained(
        hf_dir)
    text = "the model reads every sentence"
    assert tok(text).input_ids == ref_tok(text).input_ids and tok.mask_token_id == ref_tok.mask_token_id

    model = megabert.ModernBertForMaskedLM.from_pretrained(str(ckpt), megabert.init_parallel())
    ids, am, _ = modernbert_batch()
    out_logits = model(ids, attention_mask=am).logits
    close(out_logits[am.bool()], ref_logits[am.bool()], "logits of the converted checkpoint")


def _argv(d, *extra):
    return ["--data-path", str(d / "c_text_sentence"), "--seq-length", "32", "--micro-batch-size", "4",
            "--global-batch-size", "4", "--train-iters", "2", "--lr", "1e-3", "--log-interval", "1",
            "--eval-interval", "0", "--num-workers", "0", "--split", "1,0,0", *extra]


def _resolved(argv):
    from megabert.training.resolve import resolve_run

    ps = megabert.init_parallel()
    try:
        return resolve_run(parse_args(argv), ps)
    finally:
        megabert.destroy_parallel()


def test_family_defaults_and_loaded_architecture(setup):
    d, hf_dir = setup
    scratch = parse_args(_argv(d, "--model-family", "modernbert", "--vocab-file", "v", "--num-layers", "2"))
    assert scratch.model.model_family == "modernbert" and not scratch.model.bert_binary_head
    assert scratch.data.mask_prob == 0.3 and scratch.model.layernorm_epsilon == 1e-5
    assert scratch.model.ffn_hidden_size == 3 * scratch.model.hidden_size // 2
    assert parse_args(_argv(d, "--model-family", "modernbert", "--mask-prob", "0.15")).data.mask_prob == 0.15
    assert parse_args(_argv(d)).data.mask_prob == 0.15  # BERT unchanged

    loaded = _resolved(_argv(d, "--load", hf_dir, "--attention-dropout", "0.1"))  # the start's architecture
    m = loaded.model
    assert (m.model_family, m.num_layers, m.hidden_size, m.ffn_hidden_size, m.vocab_size, m.local_attention) == \
        ("modernbert", 4, 32, 48, 99, 8)
    assert m.unpad_input and m.mlm_logits_at_masked_only and m.attention_dropout == 0.1  # the flags' choices
    assert loaded.data.mask_prob == 0.3 and loaded.data.vocab_file == os.path.join(hf_dir, "tokenizer.json")
    with pytest.raises(ConfigError, match="--hidden-size 64 contradicts"):
        _resolved(_argv(d, "--load", hf_dir, "--hidden-size", "64"))


def test_continued_pretraining_first_loss_equals_transformers(setup, tmp_path):
    """pretrain_bert.py --load HF_DIR: its first logged loss is transformers' loss on the same
    batch (the trainer's unpadded encoder, masked-only logits and fused loss included)."""
    from megabert.data import build_tokenizer
    from megabert.tasks.pretraining.batches import build_batches
    from megabert.training.resolve import resolve_run

    d, hf_dir = setup
    argv = _argv(d, "--load", hf_dir, "--save", str(tmp_path / "ckpt"), "--metrics-file", str(tmp_path / "m.jsonl"))
    cfg = parse_args(argv)
    ps = megabert.init_parallel()
    run = resolve_run(cfg, ps)
    batch = next(build_batches(run, ps, build_tokenizer(run.data.tokenizer_type, run.data.vocab_file))[0](0))
    megabert.destroy_parallel()
    masked = (batch["labels"] != -100).float().mean().item() / batch["attention_mask"].float().mean().item()
    assert 0.2 < masked < 0.4  # 30% of the real tokens

    r = run_main("pretrain_bert.py", *argv)
    assert r.returncode == 0, r.stderr
    first = json.loads(open(tmp_path / "m.jsonl").readline())
    assert first["iteration"] == 1
    hf = transformers.ModernBertForMaskedLM.from_pretrained(hf_dir, attn_implementation="sdpa")
    ref = hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]).loss
    assert abs(first["lm_loss"] - ref.item()) < 1e-5 * max(1.0, ref.item()), (first["lm_loss"], ref.item())

    # The trained checkpoint exports to a directory transformers loads, with megabert's logits.
    out = tmp_path / "export"
    r = run_main("tools/checkpoint/convert_hf.py", "export", "--load", str(tmp_path / "ckpt"), "--hf-dir", str(out))
    assert r.returncode == 0, r.stderr
    logits, _ = _logits(str(out))
    model = megabert.ModernBertForMaskedLM.from_pretrained(str(tmp_path / "ckpt"), megabert.init_parallel())
    ids, am, _ = modernbert_batch()
    close(model(ids, attention_mask=am).logits[am.bool()], logits[am.bool()], "exported logits")
    assert transformers.AutoTokenizer.from_pretrained(str(out)).mask_token == "[MASK]"


def test_pretraining_from_scratch(setup, tmp_path):
    d, hf_dir = setup
    r = run_main("pretrain_bert.py", *_argv(d, "--model-family", "modernbert", "--num-layers", "2", "--hidden-size",
                                            "32", "--num-attention-heads", "2", "--local-attention", "8",
                                            "--tokenizer-type", "HuggingFaceTokenizer", "--vocab-file",
                                            os.path.join(hf_dir, "tokenizer.json"),
                                            "--metrics-file", str(tmp_path / "m.jsonl")))
    assert r.returncode == 0, r.stderr
    lines = [json.loads(line) for line in open(tmp_path / "m.jsonl")]
    assert [m["iteration"] for m in lines] == [1, 2] and all(m["lm_loss"] > 0 for m in lines)
    assert "sop_loss" not in lines[0]


def test_tokenizer_json_padding_and_truncation_change_nothing(setup, tmp_path):
    """A tokenizer.json saved with padding and truncation switched on preprocesses the corpus
    byte for byte as the plain one (Megatron's --tokenizer-model spelling)."""
    from tokenizers import Tokenizer

    d, hf_dir = setup
    tok = Tokenizer.from_file(os.path.join(hf_dir, "tokenizer.json"))
    tok.enable_padding(length=64, pad_id=0, pad_token="[PAD]")
    tok.enable_truncation(max_length=8)
    tok.save(str(tmp_path / "tokenizer.json"))
    assert json.load(open(tmp_path / "tokenizer.json"))["padding"] is not None
    r = run_main("tools/preprocess_data.py", "--input", str(d / "corpus.jsonl"), "--output-prefix", str(tmp_path / "p"),
                 "--json-keys", "text", "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                 str(tmp_path / "tokenizer.json"), "--split-sentences", "--workers", "1")
    assert r.returncode == 0, r.stderr
    for ext in ("bin", "idx"):
        assert open(tmp_path / f"p_text_sentence.{ext}", "rb").read() == open(d / f"c_text_sentence.{ext}", "rb").read()
    cfg = parse_args(_argv(d, "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", hf_dir))
    assert cfg.data.vocab_file == hf_dir


def _layout_losses(d, hf_dir, tmp_path, world, *layout):
    from tests.helpers.cli_utils import main_worker
    from tests.helpers.dist_utils import run_distributed

    metrics = tmp_path / f"m{'_'.join(layout) or 'tp1'}.jsonl"
    # Micro-batches of 2 in a global batch of 4 in every layout: the loss is a mean per
    # micro-batch, so every layout accumulates the same two (PP 2 runs a real 1F1B schedule).
    argv = _argv(d, "--load", hf_dir, "--train-iters", "3", "--attention-dropout", "0", "--micro-batch-size", "2",
                 "--metrics-file", str(metrics), *layout)
    run_distributed(main_worker, world, "pretrain_bert.py", argv)
    return [json.loads(line)["lm_loss"] for line in open(metrics)]


def test_continued_pretraining_is_layout_independent(setup, tmp_path):
    """Three steps of continued pre-training from a transformers dir: TP 2, PP 2 and DP 2 with
    the distributed optimizer give the losses of one process (the same weights, batches and
    updates)."""
    d, hf_dir = setup
    one = _layout_losses(d, hf_dir, tmp_path, 1)
    assert len(one) == 3 and one[0] != one[2]
    for layout in (("--tensor-model-parallel-size", "2"), ("--pipeline-model-parallel-size", "2"),
                   ("--use-distributed-optimizer",)):  # DP 2, ZeRO-1 of our own
        other = _layout_losses(d, hf_dir, tmp_path, 2, *layout)
        for a, b in zip(one, other):
            assert abs(a - b) < 1e-5 * max(1.0, abs(a)), (layout, one, other)


def test_both_config_json_spellings_read_alike(setup):
    """transformers 5's config.json (layer_types, rope_parameters) and the Hub's 4.x one
    (global_attn_every_n_layers, global/local_rope_theta) give one ModelConfig; a layer pattern
    megabert does not build is an error, not a silent approximation."""
    from megabert.checkpoint.hf import hf_config_from_model, model_config_from_hf

    _, hf_dir = setup
    new = json.load(open(os.path.join(hf_dir, "config.json")))
    old = {k: v for k, v in new.items() if k not in ("layer_types", "rope_parameters")}
    old.update(global_attn_every_n_layers=3, global_rope_theta=160000.0, local_rope_theta=10000.0,
               reference_compile=True, position_embedding_type="absolute")
    cfg = model_config_from_hf(new)
    assert model_config_from_hf(old) == cfg
    assert (cfg.global_attn_every_n_layers, cfg.global_rope_theta, cfg.local_rope_theta) == (3, 160000.0, 10000.0)
    written = hf_config_from_model(cfg)
    assert written["layer_types"] == new["layer_types"] and written["rope_parameters"] == new["rope_parameters"]
    assert model_config_from_hf(written) == cfg
    with pytest.raises(CheckpointError, match="layer_types"):
        model_config_from_hf({**new, "layer_types": ["sliding_attention"] + new["layer_types"][1:]})


def test_glue_finetunes_a_modernbert_and_exports_it(setup, tmp_path):
    """finetune_glue.py --load a transformers ModernBERT (masked LM) dir: its tokenizer.json and a
    ModernBertForSequenceClassification; the fine-tuned checkpoint exports to a transformers
    ModernBertForSequenceClassification that predicts what megabert predicted."""
    import numpy as np

    from tests.test_glue import MNLI_LABELS, write_mnli

    _, hf_dir = setup
    data = write_mnli(tmp_path / "MNLI", np.random.default_rng(0))
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    r = run_main("finetune_glue.py", "--task-name", "mnli", "--data-dir", data, "--load", hf_dir, "--output-dir",
                 str(out), "--max-seq-length", "48", "--micro-batch-size", "4", "--global-batch-size", "8",
                 "--train-iters", "2", "--lr", "1e-3", "--save", str(ckpt))
    assert r.returncode == 0, r.stderr
    assert 0 <= json.load(open(out / "eval_results.json"))["eval_accuracy"] <= 1
    r = run_main("tools/checkpoint/convert_hf.py", "export", "--load", str(ckpt), "--hf-dir", str(tmp_path / "hf"))
    assert r.returncode == 0, r.stderr
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "hf").eval()
    assert type(hf).__name__ == "ModernBertForSequenceClassification"
    assert hf.config.id2label == dict(enumerate(MNLI_LABELS))
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    rows = [line.split("\t") for line in open(os.path.join(data, "test_matched.tsv")).read().splitlines()[1:]]
    enc = tok([r[8] for r in rows], [r[9] for r in rows], padding=True, return_tensors="pt")
    with torch.no_grad():
        words = [hf.config.id2label[int(i)] for i in hf(**enc).logits.argmax(-1)]
    assert words == [line.split("\t")[1] for line in open(out / "MNLI-m.tsv").read().splitlines()[1:]]
