import ast
import glob
import os
import subprocess
import sys

import pytest

from megabert.arguments import parse_args
from megabert.config import ModelConfig, ParallelConfig
from megabert.presets import bert_large
from megabert.rules import validate_layout
from megabert.errors import ConfigError

from tests.helpers.cli_utils import run_main


def test_presets_and_flags_override():
    cfg = parse_args(["--preset", "bert-large", "--num-layers", "4", "--tensor-model-parallel-size", "2",
                      "--data-path", "0.3", "A", "0.7", "B", "--bf16", "--bert-no-binary-head"])
    assert cfg.model.hidden_size == 1024 and cfg.model.num_layers == 4 and cfg.model.ffn_hidden_size == 4096
    assert cfg.parallel.tensor_model_parallel_size == 2
    assert cfg.data.data_path == ["0.3", "A", "0.7", "B"]
    assert cfg.train.bf16 and not cfg.model.bert_binary_head
    assert bert_large().num_attention_heads == 16


def test_pretraining_computes_mlm_logits_at_masked_positions_by_default():
    assert parse_args([]).model.mlm_logits_at_masked_only
    assert parse_args(["--preset", "bert-base"]).model.mlm_logits_at_masked_only
    off = parse_args(["--no-mlm-logits-at-masked-only"])
    assert not off.model.mlm_logits_at_masked_only and "model.mlm_logits_at_masked_only" in off.explicit
    assert "model.mlm_logits_at_masked_only" not in parse_args([]).explicit  # a default, not typed
    assert not ModelConfig().mlm_logits_at_masked_only  # the Python API keeps transformers' full logits


def test_padded_vocab():
    m = ModelConfig(vocab_size=30522)
    assert m.padded_vocab_size(1) == 30592 and m.padded_vocab_size(2) == 30720
    assert m.padded_vocab_size(4) % 512 == 0


@pytest.mark.parametrize("kwargs,flag", [
    (dict(num_attention_heads=3, hidden_size=96), "--num-attention-heads 3"),
    (dict(ffn_hidden_size=131, num_attention_heads=2), "--ffn-hidden-size 131"),
])
def test_layout_errors_name_the_flags(kwargs, flag):
    with pytest.raises(ConfigError, match=flag):
        validate_layout(ModelConfig(**kwargs), ParallelConfig(tensor_model_parallel_size=2), world_size=2)


def test_world_size_error():
    with pytest.raises(ConfigError, match="world size 3 is not divisible"):
        validate_layout(ModelConfig(), ParallelConfig(tensor_model_parallel_size=2), world_size=3)


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _script(name: str, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, os.path.join(ROOT, name), *argv], capture_output=True, text=True)


@pytest.mark.parametrize("script,argv,message", [
    ("pretrain_bert.py", ["--hidden-size", "100", "--num-attention-heads", "3"],
     "--hidden-size 100 is not divisible by --num-attention-heads 3"),
    ("pretrain_bert.py", ["--deepspeed", "--optimizer", "lamb"], "--optimizer lamb with --deepspeed"),
    ("pretrain_bert.py", ["--seq-length", "1024"], "--seq-length 1024 exceeds --max-position-embeddings 512"),
    ("pretrain_bert.py", ["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    ("finetune_squad.py", ["--load", "x", "--train-file", "t.json", "--doc-stride", "999"],
     "--doc-stride 999 must be in [0, 317)"),
])
def test_cli_error_is_one_line_without_usage_or_traceback(script, argv, message):
    """A broken rule or a typo is one line on stderr, exit code 2: no argparse usage block
    above it, no traceback. The typo and the fine-tuning case go through the real command
    line; the others run the same main() in process (cli_utils)."""
    real = "--no-such-flag" in argv or script == "finetune_squad.py"
    r = _script(script, *argv) if real else run_main(script, *argv)
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("error: ") and message in r.stderr


def test_help_shows_every_default_and_both_deepspeed_config_spellings(tmp_path):
    text = run_main("pretrain_bert.py", "--help").stdout
    assert "--micro-batch-size MICRO_BATCH_SIZE" in text and "TRAIN.MICRO_BATCH_SIZE" not in text
    flat = " ".join(text.split())
    # The script's own defaults (masked-only MLM logits), not only the dataclasses'.
    assert "Samples per forward pass on one data-parallel rank. (default: 8)" in flat
    assert "on by default in pretrain_bert.py. (default: on)" in flat
    assert "--deepspeed_config DEEPSPEED_CONFIG, --deepspeed-config DEEPSPEED_CONFIG" in flat
    # Every flag's help names its default.
    options = [block for block in text.split("\n  --")[1:] if "show this help" not in block]
    assert len(options) > 50
    assert all("(default: " in " ".join(b.split()) for b in options), [b.split()[0] for b in options
                                                                       if "(default: " not in " ".join(b.split())]
    assert "(default: 3e-05)" in " ".join(run_main("finetune_squad.py", "--help").stdout.split())
    from megabert.arguments import parse_args
    for spelling in ("--deepspeed_config", "--deepspeed-config"):
        path = tmp_path / "ds.json"
        path.write_text("{}")
        assert parse_args(["--deepspeed", spelling, str(path)]).train.deepspeed_config == str(path)


def test_world_size_not_divisible_is_one_line_error():
    # A single process asked for TP=2: the world (1) cannot hold the layout.
    script = ("import sys, megabert\nfrom megabert.errors import cli_main\n"
              "sys.exit(cli_main(lambda: megabert.init_parallel(tensor_parallel_size=2))())")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip() == ("error: world size 1 is not divisible by --tensor-model-parallel-size 2 x "
                                "--pipeline-model-parallel-size 1; launch a multiple of 2 processes")


def test_every_design_flag_parses():
    """The CLI contract in DESIGN.md: Megatron-LM flag names."""
    argv = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 256 --seq-length 64 "
            "--max-position-embeddings 128 --micro-batch-size 2 --global-batch-size 8 --train-iters 10 --lr 1e-3 "
            "--min-lr 1e-5 --lr-warmup-iters 2 --lr-decay-style cosine --weight-decay 0.01 --clip-grad 1.0 "
            "--optimizer adam --data-path 0.3 A 0.7 B --split 949,50,1 --vocab-file v.txt "
            "--tokenizer-type BertWordPieceCase --tensor-model-parallel-size 2 --pipeline-model-parallel-size 1 "
            "--num-layers-per-virtual-pipeline-stage 1 --bf16 --recompute-granularity selective "
            "--hidden-dropout 0.0 --attention-dropout 0.0 --seed 7 --save s --load s --save-interval 5 "
            "--eval-interval 5 --eval-iters 2 --log-interval 1 --bert-no-binary-head --mask-prob 0.2 "
            "--short-seq-prob 0.05 --metrics-file m.jsonl --deepspeed --deepspeed_config ds.json --zero-stage 2")
    cfg = parse_args(argv.split())
    assert cfg.model.ffn_hidden_size == 256 and cfg.parallel.num_layers_per_virtual_pipeline_stage == 1
    assert cfg.train.zero_stage == 2 and cfg.train.deepspeed_config == "ds.json" and cfg.data.mask_prob == 0.2
    assert not cfg.model.bert_binary_head and cfg.model.recompute_granularity == "selective"
    assert parse_args(["--fp16"]).train.fp16


def _entry_scripts() -> list[str]:
    scripts = [p for p in glob.glob(os.path.join(ROOT, "*.py")) if os.path.basename(p) != "setup.py"]
    return sorted(scripts + glob.glob(os.path.join(ROOT, "tools", "*.py")) +
                  glob.glob(os.path.join(ROOT, "tools", "checkpoint", "*.py")))


def test_every_entry_script_exits_with_its_mains_code():
    """Tests run the scripts' main() in process (cli_utils.run_main, the warm pool's
    main_worker) and take its return as the exit code; that holds only if each script's
    command line is exactly `sys.exit(main())` under the __main__ guard."""
    scripts = _entry_scripts()
    assert len(scripts) >= 15, scripts
    for path in scripts:
        tree = ast.parse(open(path).read(), path)
        guards = [node for node in tree.body if isinstance(node, ast.If) and ast.unparse(node.test) in
                  ("__name__ == '__main__'", '__name__ == "__main__"')]
        assert [ast.unparse(g) for g in guards] == ["if __name__ == '__main__':\n    sys.exit(main())"], path
