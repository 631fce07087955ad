import subprocess
import sys

import pytest

from megabert.arguments import parse_args
from megabert.config import ModelConfig, ParallelConfig, bert_large, validate_layout
from megabert.errors import ConfigError


def test_presets_and_flags_override():
    cfg = parse_args(["--preset", "bert-large", "--num-layers", "4", "--tensor-model-parallel-size", "2",
                      "--data-path", "0.3", "A", "0.7", "B", "--bf16", "--bert-no-binary-head"])
    assert cfg.model.hidden_size == 1024 and cfg.model.num_layers == 4 and cfg.model.ffn_hidden_size == 4096
    assert cfg.parallel.tensor_model_parallel_size == 2
    assert cfg.data.data_path == ["0.3", "A", "0.7", "B"]
    assert cfg.train.bf16 and not cfg.model.bert_binary_head
    assert bert_large().num_attention_heads == 16


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


def test_cli_error_is_one_line_without_traceback():
    r = subprocess.run([sys.executable, "-c", "from megabert.arguments import parse_args; "
                        "parse_args(['--hidden-size', '100', '--num-attention-heads', '3'])"],
                       capture_output=True, text=True)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert "--hidden-size 100 is not divisible by --num-attention-heads 3" in r.stderr.strip().splitlines()[-1]


def test_world_size_not_divisible_is_one_line_error():
    # A single process asked for TP=2: the world (1) cannot hold the layout.
    script = ("import sys, megabert\nfrom megabert.errors import cli_main\n"
              "sys.exit(cli_main(lambda: megabert.init_parallel(tensor_parallel_size=2))())")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip() == ("error: world size 1 is not divisible by --tensor-model-parallel-size 2 x "
                                "--pipeline-model-parallel-size 1; launch a multiple of 2 processes")
