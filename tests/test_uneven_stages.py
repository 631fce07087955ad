"""Uneven pipeline stages (issue 50 item 4): Megatron's --decoder-first-pipeline-num-layers /
--decoder-last-pipeline-num-layers. The split and its one-line errors; a 5-layer BERT at PP=2
and ModernBERT-base's 22 layers at PP=4 train as one process does (fp32, dropout 0); an uneven
run resumes bitwise, continues at PP=1, and tools/checkpoint/reshard.py writes its layout."""
import pytest

from megabert.checkpoint.layout import load_file, resolve_checkpoint_dir, saved_layout
from megabert.config import ModelConfig
from megabert.errors import ConfigError
from megabert.parallel.layout import StageLayout, stage_layer_counts
from megabert.rules import check_model_split

from tests.helpers.cli_utils import run_main
from tests.helpers.dist_utils import run_distributed
from tests.helpers.train_utils import read_metrics, train_worker

FIRST, LAST = "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers"
FIVE = ["--train-iters", "4", "--num-layers", "5", "--micro-batch-size", "1", "--global-batch-size", "4"]
PP2 = ["--pipeline-model-parallel-size", "2"]
KEYS = ("lm_loss", "sop_loss", "grad_norm")


def test_split():
    assert stage_layer_counts(5, 2, first=2) == [2, 3] and stage_layer_counts(5, 2, last=2) == [3, 2]
    assert stage_layer_counts(22, 4, last=4) == [6, 6, 6, 4] and stage_layer_counts(22, 4, 7, 7) == [7, 4, 4, 7]
    assert stage_layer_counts(8, 4) == [2, 2, 2, 2]
    stages = [StageLayout(22, 4, r, first_stage_layers=4) for r in range(4)]
    assert [s.layer_ids for s in stages][:2] == [[0, 1, 2, 3], [4, 5, 6, 7, 8, 9]]
    assert [stages[0].stage_of_layer(i) for i in (0, 3, 4, 9, 10, 21)] == [0, 0, 1, 1, 2, 3]
    assert all(s.num_chunks == 1 and s.virtual_stage_layers is None for s in stages)


@pytest.mark.parametrize("args,fragment", [
    ((5, 2, None, None), "--num-layers 5 is not divisible by --pipeline-model-parallel-size 2; or give the first or "
                         "last stage its own number of layers with --decoder-first-pipeline-num-layers"),
    ((5, 2, 3, 3), "--decoder-first-pipeline-num-layers 3 and --decoder-last-pipeline-num-layers 3 add up to 6"),
    ((22, 4, 5, None), "leaves 17 layers for the other 3 stage(s) of --pipeline-model-parallel-size 4"),
    ((6, 1, 2, None), "need --pipeline-model-parallel-size > 1"),
    ((6, 2, 6, None), "--decoder-first-pipeline-num-layers 6 must be between 1 and --num-layers 6 - 1"),
])
def test_split_errors_are_one_line(args, fragment):
    with pytest.raises(ConfigError) as e:
        check_model_split(ModelConfig(num_layers=args[0], hidden_size=32, num_attention_heads=4), 1, *args[1:2], None,
                          *args[2:])
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_interleaving_with_uneven_stages_is_refused():
    with pytest.raises(ConfigError, match="cannot combine with --decoder-first-pipeline-num-layers"):
        check_model_split(ModelConfig(num_layers=6, hidden_size=32, num_attention_heads=4), 1, 2, 1, 2)


@pytest.fixture(scope="module")
def five_layers(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ref") / "m.jsonl")
    run_distributed(train_worker, 1, FIVE + ["--metrics-file", path])
    return {k: read_metrics(path, k) for k in KEYS}


@pytest.mark.parametrize("split", [[FIRST, "2"], [LAST, "2"]])
def test_five_layers_at_pp2_follow_one_process(tmp_path, five_layers, split):
    path = str(tmp_path / "m.jsonl")
    run_distributed(train_worker, 2, FIVE + PP2 + split + ["--metrics-file", path])
    for key, expected in five_layers.items():
        assert read_metrics(path, key) == pytest.approx(expected, abs=1e-5), key


def test_modernbert_base_depth_at_pp4_follows_one_process(tmp_path):
    """ModernBERT-base's 22 layers (a tiny width) over 4 stages of 6, 6, 6 and 4."""
    shape = ["--model-family", "modernbert", "--num-layers", "22", "--ffn-hidden-size", "48", "--train-iters", "2",
             "--micro-batch-size", "1", "--global-batch-size", "4"]
    one, four = str(tmp_path / "one.jsonl"), str(tmp_path / "four.jsonl")
    run_distributed(train_worker, 1, shape + ["--metrics-file", one])
    run_distributed(train_worker, 4, shape + ["--pipeline-model-parallel-size", "4", LAST, "4", "--metrics-file", four])
    for key in ("lm_loss", "grad_norm"):
        assert read_metrics(four, key) == pytest.approx(read_metrics(one, key), abs=1e-5), key


def test_uneven_checkpoints_resume_continue_and_reshard(tmp_path, five_layers):
    uneven = FIVE + PP2 + [FIRST, "2"]
    dropout = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
    full, part, ckpt = str(tmp_path / "full.jsonl"), str(tmp_path / "part.jsonl"), str(tmp_path / "ckpt")
    run_distributed(train_worker, 2, uneven + dropout + ["--metrics-file", full])
    run_distributed(train_worker, 2, uneven + dropout + ["--exit-interval", "2", "--save", ckpt, "--metrics-file", part])
    run_distributed(train_worker, 2, uneven + dropout + ["--load", ckpt, "--metrics-file", part])
    assert read_metrics(part) == read_metrics(full)  # bitwise: the same stage files read back as saved

    files = saved_layout(resolve_checkpoint_dir(ckpt)).files
    held = [{k.split(".")[3] for k in load_file(files[(0, p)])["model"] if ".encoder.layers." in k} for p in (0, 1)]
    assert held == [{"0", "1"}, {"2", "3", "4"}]  # layers under their global numbers

    # No dropout: a PP=1 run continues the uneven one; the checkpoint resharded to the other
    # split (3 + 2) continues it too, at PP=2.
    nodrop = str(tmp_path / "nodrop")
    run_distributed(train_worker, 2, uneven + ["--exit-interval", "2", "--save", nodrop])
    again = str(tmp_path / "again.jsonl")
    run_distributed(train_worker, 1, FIVE + ["--load", nodrop, "--metrics-file", again])
    assert read_metrics(again) == pytest.approx(five_layers["lm_loss"][2:], abs=1e-5)
    other = str(tmp_path / "resharded")
    r = run_main("tools/checkpoint/reshard.py", "--load", nodrop, "--save", other, "--tensor-model-parallel-size", "1",
                 "--pipeline-model-parallel-size", "2", LAST, "2")
    assert r.returncode == 0, r.stderr
    files = saved_layout(resolve_checkpoint_dir(other)).files
    assert {k.split(".")[3] for k in load_file(files[(0, 1)])["model"] if ".encoder.layers." in k} == {"3", "4"}
    moved = str(tmp_path / "moved.jsonl")
    run_distributed(train_worker, 2, FIVE + PP2 + [LAST, "2", "--load", other, "--metrics-file", moved])
    assert read_metrics(moved) == pytest.approx(five_layers["lm_loss"][2:], abs=1e-5)


def test_planner_counts_each_stage_as_built(tmp_path):
    """The planner's per-stage parameters equal the modules a 5-layer BERT builds at PP=2 (2 + 3),
    its memory prediction follows the fuller stage, and plan_layout.py takes the flags."""
    import torch

    from megabert.presets import bert_tiny
    from megabert.parallel.state import ParallelState
    from megabert.planning import Layout, Workload, estimate
    from megabert.planning.memory import estimate_stage
    from megabert.planning.params import stage_params
    from megabert.tasks.pretraining import BertForPreTraining

    cfg = bert_tiny(num_layers=5)
    layout = Layout(pp=2, first_stage_layers=2)
    for k in range(2):
        ps = ParallelState(rank=0, world_size=2, tp_size=1, pp_size=2, dp_size=1, tp_rank=0, pp_rank=k, dp_rank=0,
                           device=torch.device("cpu"), backend="gloo")
        real = BertForPreTraining(cfg, ps, device="meta", first_stage_layers=2)
        layers = len(layout.stage(cfg, k).layer_ids)
        assert stage_params(cfg, 1, 2, k, layers).total == sum(p.numel() for p in real.parameters())
    est = [estimate_stage(cfg, Workload(), layout, k) for k in range(2)]
    assert [e.params_per_rank for e in est] == [stage_params(cfg, 1, 2, k, n).total for k, n in enumerate((2, 3))]
    assert estimate(cfg, Workload(), layout).total_gb == max(e.total_gb for e in est)
    assert "--decoder-first-pipeline-num-layers 2" in layout.flags(cfg)
    r = run_main("tools/plan_layout.py", "--num-layers", "5", "--hidden-size", "128", "--num-attention-heads", "2",
                 "--pipeline-model-parallel-size", "2", "--decoder-last-pipeline-num-layers", "2")
    assert r.returncode == 0, r.stderr


def test_planner_proposes_an_uneven_last_stage():
    """ModernBERT-base's 22 layers on 4 devices: PP=4 is a candidate as 6, 6, 6 and 4 layers."""
    from megabert.presets import modernbert_base
    from megabert.planning import Workload
    from megabert.planning.search import candidate_layouts

    layouts = candidate_layouts(modernbert_base(), Workload(seq_length=512, micro_batch_size=1), 4)
    pp4 = [lay for lay in layouts if lay.pp == 4]
    assert pp4 and all(lay.last_stage_layers == 4 and lay.virtual_stages == 1 for lay in pp4)
    assert pp4[0].short().startswith("tp1.pp4(last 4)") and "--decoder-last-pipeline-num-layers 4" in pp4[0].flags()
    assert all(lay.last_stage_layers is None for lay in layouts if lay.pp == 2)  # 22 = 2 x 11
