"""`make demo`: the newcomer's end-to-end run on this machine's CPU, no download.

1. a corpus from the Python standard library's docstrings (it ships with every Python)
2. a WordPiece vocab trained on it
3. the corpus tokenized into a Megatron mmap dataset (sentence level)
4. a tiny BERT pre-trained with tensor parallelism 2 on two CPU processes (torchrun)
5. the loss curve as a PNG, and the checkpoint exported to a Hugging Face directory
6. SQuAD fine-tuning of that checkpoint on data/squad_demo (TP 2 on two CPU processes),
   predictions on its dev set and the official EM/F1
7. GLUE fine-tuning of that checkpoint on a small SST-2-format task built from the corpus
   (docstring sentences: "says what it returns" or "what it raises"), its dev accuracy and
   the GLUE submission file of its test set
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable
# torchrun as a module: a venv that reuses a GPU image's torch (make install does) has no
# torchrun script of its own.
TORCHRUN = [PY, "-m", "torch.distributed.run"]
# The demo is sized for a CPU and says so: on a GPU machine the two TP ranks would both land
# on a single GPU (NCCL refuses that), so the runs keep to gloo, which keeps them on the CPU.
CPU = ["--distributed-backend", "gloo"]


# The figures are the same on every run (issue 51): every sample, shuffle and dropout mask is
# seeded, and the vocab is trained deterministically (megabert.corpus.bpe_merges). What a
# float sum gives also depends on how many threads split it: torchrun runs each rank on one
# thread, and the one-process GLUE step gets a fixed two (the demo's size) rather than the
# machine's core count, so a machine with more cores prints the same figures.
ONE_PROCESS_THREADS = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}


def step(title: str, cmd: list[str], env: dict | None = None) -> None:
    print(f"\n== {title}\n$ {' '.join(os.path.relpath(c, ROOT) if c.startswith(ROOT) else c for c in cmd)}",
          flush=True)
    t0 = time.perf_counter()
    r = subprocess.run(cmd, cwd=ROOT, env=None if env is None else {**os.environ, **env})
    if r.returncode != 0:
        sys.exit(f"demo: '{title}' failed (exit code {r.returncode}); see the lines above")
    print(f"   ({time.perf_counter() - t0:.0f} s)", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", default="demo_out")
    p.add_argument("--train-iters", type=int, default=300)
    p.add_argument("--max-documents", type=int, default=4000, help="corpus size (documents)")
    p.add_argument("--squad-epochs", type=float, default=10, help="SQuAD fine-tuning epochs")
    p.add_argument("--glue-epochs", type=float, default=5, help="GLUE fine-tuning epochs")
    args = p.parse_args()
    w = os.path.abspath(args.workdir)
    os.makedirs(w, exist_ok=True)
    tool = lambda *parts: os.path.join(ROOT, "tools", *parts)  # noqa: E731

    step("1/7 corpus from the standard library's docstrings",
         [PY, tool("make_demo_corpus.py"), "--output", f"{w}/corpus.jsonl", "--max-documents",
          str(args.max_documents)])
    step("2/7 WordPiece vocab",
         [PY, tool("train_tokenizer.py"), "--input", f"{w}/corpus.jsonl", "--output", f"{w}/vocab.txt",
          "--vocab-size", "8000"])
    step("3/7 preprocess into a Megatron mmap dataset",
         [PY, tool("preprocess_data.py"), "--input", f"{w}/corpus.jsonl", "--json-keys", "text",
          "--output-prefix", f"{w}/demo", "--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file",
          f"{w}/vocab.txt", "--split-sentences", "--workers", "2", "--log-interval", "1000"])
    metrics = f"{w}/metrics.jsonl"
    if os.path.exists(metrics):
        os.remove(metrics)
    step("4/7 pre-train a tiny BERT, tensor parallel over 2 CPU processes",
         [*TORCHRUN, "--nproc-per-node", "2", os.path.join(ROOT, "pretrain_bert.py"),
          "--preset", "bert-tiny", "--tensor-model-parallel-size", "2", "--data-path", f"{w}/demo_text_sentence",
          "--vocab-file", f"{w}/vocab.txt", "--seq-length", "128", "--micro-batch-size", "16",
          "--global-batch-size", "32", "--train-iters", str(args.train_iters), "--lr", "1e-3",
          "--lr-warmup-iters", "30", "--lr-decay-style", "cosine", "--min-lr", "1e-4", "--split", "95,5,0",
          "--eval-interval", "100", "--eval-iters", "4", "--log-interval", "20", "--mlm-logits-at-masked-only",
          "--metrics-file", metrics, "--save", f"{w}/checkpoint", "--num-workers", "1"] + CPU)
    step("5/7 loss curve and Hugging Face export",
         [PY, tool("plot_metrics.py"), metrics, "--output", f"{w}/loss_curve.png"])
    step("    export", [PY, tool("checkpoint", "convert_hf.py"), "export", "--load", f"{w}/checkpoint",
                        "--hf-dir", f"{w}/hf_export"])
    # 120 questions, contexts of about 80 tokens: one window each at 128 tokens. A tiny
    # model needs a higher learning rate than BERT-base's 3e-5.
    squad = os.path.join(ROOT, "data", "squad_demo")
    step("6/7 fine-tune on SQuAD-format data, tensor parallel over 2 CPU processes",
         [*TORCHRUN, "--nproc-per-node", "2", os.path.join(ROOT, "finetune_squad.py"),
          "--tensor-model-parallel-size", "2", "--load", f"{w}/checkpoint", "--vocab-file", f"{w}/vocab.txt",
          "--train-file", f"{squad}/train.json", "--predict-file", f"{squad}/dev.json", "--output-dir", f"{w}/squad",
          "--max-seq-length", "128", "--doc-stride", "32", "--max-query-length", "32", "--epochs",
          str(args.squad_epochs), "--lr", "1e-3", "--micro-batch-size", "16", "--global-batch-size", "16",
          "--seed", "1234", "--log-interval", "25"] + CPU)

    # 400 sentences, about 20 tokens each: one epoch is 13 steps of 32. A tiny model takes a
    # higher learning rate than BERT-base's 2e-5.
    step("7/7 fine-tune on a GLUE task (SST-2 format) built from the corpus",
         [PY, tool("make_demo_glue.py"), "--corpus", f"{w}/corpus.jsonl", "--output", f"{w}/glue/SST-2",
          "--train-per-class", "200", "--dev-per-class", "100", "--test-per-class", "25"])
    step("    fine-tune", [PY, os.path.join(ROOT, "finetune_glue.py"), "--task-name", "sst-2", "--data-dir",
                          f"{w}/glue/SST-2", "--load", f"{w}/checkpoint", "--vocab-file", f"{w}/vocab.txt",
                          "--output-dir", f"{w}/glue/out", "--max-seq-length", "64", "--epochs",
                          str(args.glue_epochs), "--lr", "2e-3", "--micro-batch-size", "32", "--seed", "1234",
                          "--log-interval", "10"] + CPU, env=ONE_PROCESS_THREADS)

    rows = [json.loads(line) for line in open(metrics)]
    train = [r for r in rows if "lm_loss" in r]
    valid = [r for r in rows if "valid_lm_loss" in r]
    print("\n== result")
    # Each logged loss is the mean over the iterations since the previous logged one.
    first, last = train[0], train[-1]
    since = train[-2]["iteration"] + 1 if len(train) > 1 else 1
    print(f"masked-LM loss {first['lm_loss']:.3f} (iterations 1-{first['iteration']}) -> "
          f"{last['lm_loss']:.3f} (iterations {since}-{last['iteration']}); uniform guess ln(8000) = 8.99")
    if valid:
        print(f"validation masked-LM loss at iteration {valid[-1]['iteration']}: {valid[-1]['valid_lm_loss']:.3f}")
    print(f"throughput {train[-1]['samples_per_sec']:.1f} samples/s on this CPU")
    print(f"loss curve: {w}/loss_curve.png | checkpoint: {w}/checkpoint | Hugging Face export: {w}/hf_export")
    squad_results = json.load(open(f"{w}/squad/eval_results.json"))
    print(f"SQuAD-format dev set ({squad}/dev.json, 40 questions): exact match {squad_results['exact_match']:.1f}, "
          f"F1 {squad_results['f1']:.1f} (a tiny BERT pre-trained for {args.train_iters} iterations and fine-tuned "
          f"on 120 questions: expect low figures)")
    print(f"predictions: {w}/squad/predictions.json")
    glue = json.load(open(f"{w}/glue/out/eval_results.json"))
    print(f"GLUE task in SST-2 format ({w}/glue/SST-2, {glue['eval_samples']} dev sentences, half of each class): "
          f"accuracy {glue['eval_accuracy']:.3f} (chance 0.5) | submission file: {w}/glue/out/SST-2.tsv")
    return 0


if __name__ == "__main__":
    sys.exit(main())
