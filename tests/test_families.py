"""The family registry (megabert.families): one spec per config, one-line errors for a config.json
megabert cannot build (never BERT by default), and no family branch outside the registry."""
from __future__ import annotations

import dataclasses
import os
import re

import pytest

import megabert
from megabert.checkpoint import hf as hf_io
from megabert.errors import CheckpointError, ConfigError
from megabert.families import FAMILIES, encoder_spec, get_family
from megabert.families.spec import AttentionSpec, NormSpec

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "megabert")


def test_bert_and_modernbert_specs_say_what_they_are():
    bert = encoder_spec(megabert.ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=2))
    assert not bert.pre_norm and bert.embeddings.max_positions == 512 and bert.embeddings.type_vocab_size == 2
    assert bert.mlp.kind == "plain" and not bert.attention.rope and bert.classifier.pooling == "pooler"
    modern = encoder_spec(megabert.modernbert_tiny(num_layers=4, hidden_size=32, num_attention_heads=2))
    assert modern.pre_norm and not modern.first_layer_attn_norm and modern.embeddings.max_positions == 0
    assert modern.mlp.kind == "glu" and modern.attention.layer_types[:4] == (
        "full_attention", "sliding_attention", "sliding_attention", "full_attention")
    assert modern.attention.window(1) == 64 and modern.attention.window(0) is None
    assert modern.attention.theta(0) == 160000.0 and modern.attention.theta(1) == 10000.0


@pytest.mark.parametrize("make, message", [
    (lambda: NormSpec(kind="batchnorm"), "norm kind"),
    (lambda: NormSpec(kind="rmsnorm", bias=True), "RMSNorm has no bias"),
    (lambda: AttentionSpec(num_heads=6, num_kv_heads=4, head_dim=8, layer_types=("full_attention",)), "do not group"),
    (lambda: AttentionSpec(num_heads=4, num_kv_heads=4, head_dim=8, layer_types=("full_attention",),
                           half_window={"sliding_attention": 4}), "no layer has"),
    (lambda: AttentionSpec(num_heads=4, num_kv_heads=4, head_dim=8, layer_types=("full_attention", "sliding"),
                           rope_theta={"full_attention": 1e4}), "a base for every layer type"),
])
def test_a_spec_that_cannot_be_built_stops_where_it_is_made(make, message):
    with pytest.raises(ConfigError, match=message):
        make()


def _write(tmp_path, text: str) -> str:
    (tmp_path / "config.json").write_text(text)
    return str(tmp_path)


@pytest.mark.parametrize("text, message", [
    ("{not json", r"config.json is not JSON"),
    ("[1, 2]", r"config.json holds a JSON list"),
])
def test_an_unreadable_config_json_is_one_line_naming_the_file(tmp_path, text, message):
    with pytest.raises(CheckpointError, match=message) as e:
        hf_io.read_hf_config(_write(tmp_path, text))
    assert "\n" not in str(e.value)


BERT = {"model_type": "bert", "num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 2,
        "intermediate_size": 64, "vocab_size": 99, "max_position_embeddings": 64}
MODERN = {"model_type": "modernbert", "num_hidden_layers": 3, "hidden_size": 32, "num_attention_heads": 2,
          "intermediate_size": 48, "vocab_size": 99}


@pytest.mark.parametrize("config, message", [
    ({**BERT, "model_type": "gpt2"}, r"model_type 'gpt2' is not a family megabert builds"),
    ({k: v for k, v in BERT.items() if k != "hidden_size"}, r"lacks 'hidden_size'"),
    ({**BERT, "hidden_size": "32"}, r"hidden_size \(ModelConfig field\) is '32'"),
    ({**MODERN, "global_attn_every_n_layers": 0}, r"global-attn-every-n-layers must be >= 1"),
])
def test_a_config_megabert_cannot_build_is_an_error_not_bert(config, message):
    with pytest.raises(CheckpointError, match=message) as e:
        hf_io.model_config_from_hf(config, "DIR/config.json")
    assert "\n" not in str(e.value) and "DIR/config.json" in str(e.value)


def test_every_family_round_trips_its_config_json():
    for name, config in (("bert", BERT), ("modernbert", MODERN)):
        cfg = hf_io.model_config_from_hf(config)
        assert cfg.model_family == name
        assert hf_io.model_config_from_hf(hf_io.hf_config_from_model(cfg)) == cfg


def test_a_task_class_of_another_family_names_the_right_one():
    with pytest.raises(ConfigError, match="build ModernBertForQuestionAnswering"):
        megabert.BertForQuestionAnswering(megabert.modernbert_tiny(num_layers=1, hidden_size=32, vocab_size=99),
                                          megabert.init_parallel())
    with pytest.raises(ConfigError, match="unknown model family 'gpt'"):
        get_family("gpt")


def _family_branches(line: str) -> bool:
    """A line that compares a family to a name, or lists two or more family names (a table of them)."""
    name = "[\"'](?:" + "|".join(re.escape(n) for n in FAMILIES) + ")[\"']"
    compared = r"model_family\s*(?:[!=]=|\bin\b)\s*[(\[{]?\s*[\"']"
    return bool(re.search(f"{compared}|[!=]=\\s*{name}|{name}\\s*[!=]=|{name}\\s*,\\s*{name}", line))


@pytest.mark.parametrize("line", [
    'self.ffn_hidden_size = 3 * h // 2 if self.model_family == "modernbert" else 4 * h',  # config.py before issue 50
    'FAMILY_NAMES = ("bert", "modernbert", "eurobert", "gte", "nomic_bert", "ultrabert")',
    "if cfg.model_family in ('gte', 'nomic_bert'):", 'if "eurobert" != name:'])
def test_the_family_branch_grep_catches_a_branch(line):
    assert _family_branches(line)


def test_no_family_branch_outside_the_registry():
    """Code outside megabert/families reads the spec and the registry (defaults, names); it never
    compares a family's name nor keeps a table of names."""
    found = []
    for folder, _, files in os.walk(ROOT):
        if os.path.relpath(folder, ROOT).split(os.sep)[0] == "families":
            continue
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                for i, line in enumerate(open(path), 1):
                    if _family_branches(line):
                        found.append(f"{os.path.relpath(path, ROOT)}:{i}")
    assert found == [], found
    assert set(FAMILIES) >= {"bert", "modernbert", "eurobert", "gte", "nomic_bert", "ultrabert"}


def _tiny(family: str) -> megabert.ModelConfig:
    from tests.helpers.family_models import family_config

    cfg, _ = family_config(family)
    return hf_io.model_config_from_hf(cfg.to_dict())


NEW_FAMILIES = ["eurobert", "gte", "nomic_bert", "ultrabert"]


def _built(cfg, ps) -> int:
    return sum(p.numel() for p in megabert.AutoModelForMaskedLM(cfg, ps, device="meta").parameters())


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_planner_counts_equal_the_built_model(family):
    """The planner's parameter counts come from the spec (no per-family formula): they equal
    what each family's masked LM builds on every pipeline stage (shape only, on the meta device)."""
    from megabert.parallel.state import ParallelState
    from megabert.planning.params import stage_params

    cfg = _tiny(family)
    for pp in (1, 2):
        for stage in range(pp):
            assert _built(cfg, ParallelState.offline(pp, stage)) == stage_params(cfg, 1, pp, stage).total, (pp, stage)


def _tp2_counts(rank, world):
    import datetime

    import torch

    from megabert.parallel.state import ParallelState
    from megabert.planning.params import stage_params

    ps = ParallelState.build(2, 1, device=torch.device("cpu"), backend="gloo", timeout=datetime.timedelta(minutes=10))
    for family in NEW_FAMILIES + ["eurobert_mqa"]:
        cfg = _tiny(family.split("_mqa")[0])
        if family.endswith("_mqa"):  # one key/value head: replicated on both TP ranks
            cfg = dataclasses.replace(cfg, num_query_groups=1)
        assert _built(cfg, ps) == stage_params(cfg, 2, 1, 0).total, family


def test_planner_counts_at_tp2_equal_each_rank_built():
    from tests.helpers.dist_utils import run_distributed

    run_distributed(_tp2_counts, 2)


def test_flops_follow_the_spec():
    """GQA's smaller K/V, SwiGLU's three matrices, windows and the bottleneck head, counted."""
    from megabert.planning.flops import bert_flops_per_sample

    cfg = _tiny("ultrabert")  # 4 layers (3 sliding, w = 3), h 32, 4 heads of 8, 2 kv heads, f 48, head 24
    h, f, s, v = 32, 48, 20, 99
    proj = 2 * (h * (32 + 2 * 16) + 32 * h) + 2 * h * f * 3
    layers = 3 * (proj + 4 * 7 * 32) + (proj + 4 * s * 32)
    head = 2 * h * 24 + 2 * 24 * h + 2 * h * v
    assert bert_flops_per_sample(cfg, s) == 3 * (s * layers + s * head)
