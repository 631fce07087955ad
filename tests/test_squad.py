"""finetune_squad.py end to end: under torchrun at TP=2 (the launcher's one test), then DP=2
train, save and predict; a SIGKILLed run resumed from --save; SQuAD v2; one-line errors for
bad files and flags. Everything but the torchrun test and the process to kill runs
finetune_squad.py's main() on the warm worker pool's ranks, as torchrun would. The data path
(features, post-processing, evaluation): tests/test_squad_data.py."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from megabert.errors import ConfigError

from tests.helpers.cli_utils import main_worker, run_main
from tests.helpers.dist_utils import run_distributed
from tests.helpers.pretrain_runs import TORCHRUN, run_ranks
from tests.helpers.squad_demo import DEMO, ROOT, train_demo_vocab




@pytest.fixture(scope="module")
def demo_vocab(tmp_path_factory):
    return train_demo_vocab(str(tmp_path_factory.mktemp("demo_vocab") / "vocab.txt"))

@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory, demo_vocab):
    """A tiny random BertForPreTraining from transformers, imported as a megabert checkpoint (TP=1)."""
    transformers = pytest.importorskip("transformers")
    import torch

    d = tmp_path_factory.mktemp("tiny")
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=400, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=128)
    transformers.BertForPreTraining(cfg).save_pretrained(d / "hf")
    r = run_main("tools/checkpoint/convert_hf.py", "import", "--hf-dir", str(d / "hf"), "--output", str(d / "ckpt"))
    assert r.returncode == 0, r.stderr[-3000:]
    return d / "ckpt"


def finetune_under_torchrun(procs, *args):
    cmd = [*TORCHRUN, "--nproc-per-node", str(procs), "--standalone", os.path.join(ROOT, "finetune_squad.py")]
    return subprocess.run(cmd + [str(a) for a in args], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def finetune_on_ranks(procs, *args, log):
    """finetune_squad.py's main() on the warm pool's ranks, as `torchrun --nproc-per-node
    procs` runs it (the launcher: test_finetune_tp2_end_to_end); what rank 0 logged."""
    return run_ranks(procs, [os.path.join(ROOT, "finetune_squad.py"), *args], log=log)


def finetune_in_process(*args):
    """finetune_squad.py's main() in this process (cli_utils): its one-line errors without
    a new interpreter."""
    return run_main("finetune_squad.py", *map(str, args))


def common(ckpt, vocab, out):
    return ["--load", ckpt, "--vocab-file", vocab, "--output-dir", out, "--max-seq-length", 64, "--doc-stride", 16,
            "--max-query-length", 24, "--micro-batch-size", 4, "--seed", 7, "--log-interval", 1]


def dev_ids():
    data = json.load(open(os.path.join(DEMO, "dev.json")))["data"]
    return {qa["id"] for a in data for p in a["paragraphs"] for qa in p["qas"]}


def test_finetune_tp2_end_to_end(tiny_checkpoint, demo_vocab, tmp_path):
    out = tmp_path / "out"
    r = finetune_under_torchrun(2, *common(tiny_checkpoint, demo_vocab, out), "--tensor-model-parallel-size", 2,
                                "--train-file", os.path.join(DEMO, "train.json"), "--predict-file",
                                os.path.join(DEMO, "dev.json"), "--epochs", 1, "--train-iters", 3, "--global-batch-size", 8,
                                "--lr", 1e-3)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert [line.split(" |")[0] for line in r.stdout.splitlines() if line.startswith("iteration ")] == \
        ["iteration 1", "iteration 2", "iteration 3"]
    predictions = json.load(open(out / "predictions.json"))
    assert set(predictions) == dev_ids() and all(isinstance(v, str) for v in predictions.values())
    results = json.load(open(out / "eval_results.json"))
    assert set(results) == {"exact_match", "f1"} and 0 <= results["exact_match"] <= results["f1"] <= 100
    nbest = json.load(open(out / "nbest_predictions.json"))
    assert set(nbest) == dev_ids() and all(1 <= len(v) <= 20 for v in nbest.values())
    assert "exact_match" in r.stdout  # rank 0 prints the figures


def test_finetune_dp2_train_save_and_predict_equal_tp2(tiny_checkpoint, demo_vocab, tmp_path):
    """DP=2 trains and saves a QA checkpoint; predicting from it at TP=2 (two processes) and
    at DP=1 (one process) gives the same answers and scores."""
    finetune_on_ranks(2, *common(tiny_checkpoint, demo_vocab, tmp_path / "unused"), "--train-file",
                      os.path.join(DEMO, "train.json"), "--train-iters", 2, "--global-batch-size", 8, "--lr", 1e-3,
                      "--save", tmp_path / "qa", log=tmp_path / "train.log")
    assert not (tmp_path / "unused").exists()  # train only: nothing predicted
    outs = {}
    for procs, extra in ((2, ["--tensor-model-parallel-size", 2]), (1, [])):
        out = tmp_path / f"pred{procs}"
        log = finetune_on_ranks(procs, *common(tmp_path / "qa", demo_vocab, out), "--predict-file",
                                os.path.join(DEMO, "dev.json"), *extra, log=tmp_path / f"pred{procs}.log")
        assert "initialised from the seed" not in log  # the QA head came from the checkpoint
        outs[procs] = (json.load(open(out / "predictions.json")), json.load(open(out / "eval_results.json")))
    assert outs[2][0] == outs[1][0] and set(outs[1][0]) == dev_ids()
    assert outs[2][1] == pytest.approx(outs[1][1])


def _losses(metrics) -> dict:
    """The last qa_loss logged for each iteration (a resumed run logs some twice)."""
    return {r["iteration"]: r["qa_loss"] for r in map(json.loads, open(metrics)) if "qa_loss" in r}


def test_killed_finetuning_resumes_with_the_same_command(tiny_checkpoint, demo_vocab, tmp_path):
    """A SQuAD fine-tuning SIGKILLed between two saves, then run again with the same command,
    ends with the losses (bitwise) and predictions of a run that was never interrupted,
    dropout on: weights, optimizer, RNG streams and data position come back from --save."""
    iters = 30  # saves every 3: the kill lands after the first, with iterations to spare

    def command(name):
        return [*map(str, common(tiny_checkpoint, demo_vocab, tmp_path / name)), "--train-file",
                os.path.join(DEMO, "train.json"), "--predict-file", os.path.join(DEMO, "dev.json"), "--train-iters",
                str(iters), "--global-batch-size", "8", "--lr", "1e-3", "--save", str(tmp_path / f"{name}_ck"),
                "--save-interval", "3", "--metrics-file", str(tmp_path / f"{name}.jsonl")]

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    tracker = tmp_path / "killed_ck" / "latest_checkpointed_iteration.txt"
    # The run to kill is a process of its own; the same command again and the uninterrupted
    # reference run as main() on the warm pool's rank (one thread each, as OMP_NUM_THREADS=1).
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "finetune_squad.py"), *command("killed")], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not tracker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
        err = proc.communicate(timeout=60)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL, err[-3000:]  # killed mid-run, not ended
    saved_at = int(tracker.read_text())
    assert saved_at < iters and saved_at % 3 == 0
    again = finetune_on_ranks(1, *command("killed"), log=tmp_path / "again.log")
    assert f"loaded {tmp_path / 'killed_ck'}: iteration" in again  # resumed, not restarted
    finetune_on_ranks(1, *command("ref"), log=tmp_path / "ref.log")
    killed, uninterrupted = _losses(tmp_path / "killed.jsonl"), _losses(tmp_path / "ref.jsonl")
    assert sorted(killed) == list(range(1, iters + 1))
    assert killed == uninterrupted  # bitwise
    for name in ("predictions.json", "nbest_predictions.json", "eval_results.json"):
        assert json.load(open(tmp_path / "killed" / name)) == json.load(open(tmp_path / "ref" / name)), name


@pytest.fixture(scope="module")
def no_dropout_qa(tmp_path_factory):
    """A tiny random BertForQuestionAnswering from transformers without dropout, so
    layouts can be compared step by step."""
    transformers = pytest.importorskip("transformers")
    import torch

    d = tmp_path_factory.mktemp("qa")
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=400, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=128, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0)
    transformers.BertForQuestionAnswering(cfg).save_pretrained(d / "hf")
    return d / "hf"


def finetune_losses(tmp_path, hf_dir, vocab, name, procs, *extra, predict=False):
    metrics = tmp_path / f"{name}.jsonl"
    more = ["--predict-file", os.path.join(DEMO, "dev.json")] if predict else []
    argv = [*common(hf_dir, vocab, tmp_path / name), "--train-file", os.path.join(DEMO, "train.json"),
            "--train-iters", 6, "--global-batch-size", 8, "--lr", 1e-3, "--metrics-file", metrics, *more, *extra]
    run_distributed(main_worker, procs, "finetune_squad.py", [str(a) for a in argv])
    return [json.loads(line)["qa_loss"] for line in open(metrics)]


@pytest.fixture(scope="module")
def plain_dp2(tmp_path_factory, no_dropout_qa, demo_vocab):
    """Plain DP=2 fine-tuning, (losses, its run directory): one layout of the comparison
    below and the reference of every ZeRO stage and the distributed optimizer (launched
    once for all of them)."""
    d = tmp_path_factory.mktemp("dp2")
    return finetune_losses(d, no_dropout_qa, demo_vocab, "dp2", 2, predict=True), d / "dp2"


@pytest.fixture(scope="module")
def plain_dp2_losses(plain_dp2):
    return plain_dp2[0]


def test_finetune_losses_equal_across_layouts(no_dropout_qa, demo_vocab, plain_dp2_losses, tmp_path):
    """Without dropout, fine-tuning losses over 6 steps at TP=2, DP=2, PP=2 and TP=2 x PP=2
    equal one process's (gradient accumulation over the same global batch): the same
    features reach the same step, through the same model definition at every layout.
    Predictions through pipeline stages equal one process's."""
    one = finetune_losses(tmp_path, no_dropout_qa, demo_vocab, "one", 1, predict=True)
    assert len(one) == 6 and one[-1] < one[0]
    assert plain_dp2_losses == pytest.approx(one, abs=1e-4), "dp2"
    layouts = {"tp2": (2, ["--tensor-model-parallel-size", 2]), "pp2": (2, ["--pipeline-model-parallel-size", 2]),
               "tp2pp2": (4, ["--tensor-model-parallel-size", 2, "--pipeline-model-parallel-size", 2])}
    for name, (procs, extra) in layouts.items():
        losses = finetune_losses(tmp_path, no_dropout_qa, demo_vocab, name, procs, *extra, predict=name == "pp2")
        assert losses == pytest.approx(one, abs=1e-4), name
    assert json.load(open(tmp_path / "pp2" / "predictions.json")) == json.load(open(tmp_path / "one" / "predictions.json"))


@pytest.mark.parametrize("stage,offload", [(1, False), (2, False), (3, False), (3, True)],
                         ids=["zero1", "zero2", "zero3", "zero3-offload"])
def test_finetune_with_zero_equals_plain_data_parallel(no_dropout_qa, demo_vocab, plain_dp2_losses, tmp_path, stage,
                                                      offload):
    """BingBertSquad's workflow: SQuAD under DeepSpeed ZeRO at DP=2 follows plain DP=2;
    with optimizer and parameter offload (the same fused AdamW, on the CPU partitions) too."""
    pytest.importorskip("deepspeed")
    flags = ["--zero-offload-optimizer", "cpu", "--zero-offload-params", "cpu"] if offload else []
    zero = finetune_losses(tmp_path, no_dropout_qa, demo_vocab, f"zero{stage}", 2, "--deepspeed", "--zero-stage", stage,
                           *flags, predict=True)
    assert zero == pytest.approx(plain_dp2_losses, abs=1e-4)
    assert set(json.load(open(tmp_path / f"zero{stage}" / "predictions.json"))) == dev_ids()


def test_finetune_with_distributed_optimizer_equals_plain_data_parallel(no_dropout_qa, demo_vocab, plain_dp2,
                                                                        tmp_path):
    """--use-distributed-optimizer fine-tunes as plain DP=2 does (fp32: the losses to 1e-6),
    and predicts from the final weights (the last step's parameter all-gathers were still
    in flight when training ended): plain DP's answers."""
    losses, plain_dir = plain_dp2
    sharded = finetune_losses(tmp_path, no_dropout_qa, demo_vocab, "distopt", 2, "--use-distributed-optimizer",
                              predict=True)
    assert sharded == pytest.approx(losses, abs=1e-6, rel=0)
    assert json.load(open(tmp_path / "distopt" / "predictions.json")) == \
        json.load(open(plain_dir / "predictions.json"))


def test_finetune_squad_v2(tiny_checkpoint, demo_vocab, tmp_path):
    """SQuAD 2.0: unanswerable questions train on [CLS]; the scores carry HasAns_/NoAns_ fields."""
    data = json.load(open(os.path.join(DEMO, "dev.json")))
    data["version"] = "v2.0"
    for a in data["data"]:
        for p in a["paragraphs"]:
            for k, qa in enumerate(p["qas"]):
                qa["is_impossible"] = k % 2 == 1
                if qa["is_impossible"]:
                    qa["answers"] = []
    path = tmp_path / "v2.json"
    path.write_text(json.dumps(data))
    out = tmp_path / "out"
    finetune_on_ranks(1, *common(tiny_checkpoint, demo_vocab, out), "--version-2-with-negative", "--train-file", path,
                      "--predict-file", path, "--train-iters", 2, "--null-score-diff-threshold", 0.5,
                      log=tmp_path / "log")
    results = json.load(open(out / "eval_results.json"))
    assert list(results) == ["exact", "f1", "total", "HasAns_exact", "HasAns_f1", "HasAns_total", "NoAns_exact",
                             "NoAns_f1", "NoAns_total"]
    assert (results["total"], results["HasAns_total"], results["NoAns_total"]) == (40, 24, 16)
    predictions, odds = json.load(open(out / "predictions.json")), json.load(open(out / "null_odds.json"))
    assert set(predictions) == set(odds) == dev_ids()
    assert all((text == "") == (odds[q] > 0.5) for q, text in predictions.items())
    r = run_main("tools/squad_evaluate.py", str(path), str(out / "predictions.json"))
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == pytest.approx(results)


def test_predict_only_from_hugging_face_dir_uses_its_vocab(tiny_checkpoint, demo_vocab, tmp_path):
    import shutil

    hf_dir = tmp_path / "hf"
    shutil.copytree(tiny_checkpoint.parent / "hf", hf_dir)
    shutil.copy(demo_vocab, hf_dir / "vocab.txt")
    args = common(hf_dir, demo_vocab, tmp_path / "out")
    del args[2:4]  # no --vocab-file: the directory's vocab.txt
    finetune_on_ranks(1, *args, "--predict-file", os.path.join(DEMO, "dev.json"), log=tmp_path / "log")
    assert set(json.load(open(tmp_path / "out" / "predictions.json"))) == dev_ids()


@pytest.mark.parametrize("case", ["missing", "malformed"])
def test_finetune_bad_file_is_one_line_error(tiny_checkpoint, demo_vocab, tmp_path, case):
    path = tmp_path / "train.json"
    if case == "malformed":
        path.write_text('{"version": "1.1", "data": [{"title": "x", ')
    r = finetune_in_process(*common(tiny_checkpoint, demo_vocab, tmp_path / "out"), "--train-file", path)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and str(path) in lines[0], r.stderr
    assert ("does not exist" if case == "missing" else "is not valid JSON") in lines[0]


def test_finetune_flag_errors(tiny_checkpoint, demo_vocab, tmp_path):
    r = finetune_in_process("--load", tiny_checkpoint, "--vocab-file", demo_vocab)
    assert r.returncode == 2 and "give --train-file, --predict-file or both" in r.stderr
    r = finetune_in_process(*common(tiny_checkpoint, demo_vocab, tmp_path), "--predict-file",
                            os.path.join(DEMO, "dev.json"), "--max-seq-length", 256)
    assert r.returncode == 2 and "--max-seq-length 256 exceeds the model's 128 position embeddings" in r.stderr
    # --save resumes the run it holds: the pre-trained --load must not be taken for it (nor saved over).
    r = finetune_in_process(*common(tiny_checkpoint, demo_vocab, tmp_path), "--train-file",
                            os.path.join(DEMO, "train.json"), "--save", tiny_checkpoint)
    assert r.returncode == 2 and f"--save {tiny_checkpoint} is also --load" in r.stderr


def test_finetune_flags_parse_with_bert_recipe_defaults():
    from megabert.arguments import parse_finetune_args
    from megabert.tasks.squad.config import SquadConfig

    argv = ("--train-file t.json --predict-file d.json --vocab-file v.txt --load ckpt --max-seq-length 256 "
            "--doc-stride 64 --max-query-length 32 --epochs 3 --lr 5e-5 --micro-batch-size 4 "
            "--global-batch-size 32 --seed 42 --output-dir out --version-2-with-negative "
            "--null-score-diff-threshold -1.5 --tokenizer-type BertWordPieceCase --tensor-model-parallel-size 2")
    cfg = parse_finetune_args(argv.split(), task_config=SquadConfig)
    ft = cfg.finetune
    assert (ft.max_seq_length, ft.doc_stride, ft.max_query_length, ft.epochs) == (256, 64, 32, 3.0)
    assert ft.version_2_with_negative and ft.null_score_diff_threshold == -1.5 and cfg.train.seed == 42
    assert cfg.optim.lr == 5e-5 and cfg.train.global_batch_size == 32 and cfg.parallel.tensor_model_parallel_size == 2
    recipe = parse_finetune_args(["--train-file", "t.json", "--load", "ckpt"], task_config=SquadConfig)
    assert (recipe.optim.lr, recipe.optim.lr_warmup_fraction, recipe.optim.lr_decay_style) == (3e-5, 0.1, "linear")
    assert recipe.optim.optimizer == "adam" and recipe.optim.weight_decay == 0.01
    with pytest.raises(ConfigError, match="--doc-stride 317 must be in"):
        SquadConfig(train_file="t.json", doc_stride=317)
    with pytest.raises(ConfigError, match="--predict-file needs --output-dir"):
        SquadConfig(predict_file="d.json")
