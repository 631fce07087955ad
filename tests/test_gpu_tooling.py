"""The GPU tooling that runs without a GPU: the ptxas report of `make cuda-check`
(tools/gpu/ptxas_report.py) on captured nvcc 13.0 output, how `make install` makes its
venv on a GPU image (tools/gpu/make_venv.py), and `make bench-gpu`'s stopping line and
figure parsers (tools/gpu/bench_gpu.py, bench_figures.py); the kernel breakdown is in
tests/test_kernel_breakdown.py."""
import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tool(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "tools", "gpu", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


ptxas_report = _tool("ptxas_report")
make_venv = _tool("make_venv")

# `nvcc -Xptxas -v` (CUDA 13.0) on softmax.cu and layer_norm.cu before the sm_80 spill fix;
# names shortened to two kernels, lines as ptxas printed them.
SOFTMAX_BWD = "_ZN8megabert4cuda43_GLOBAL__N__3c379ac9_10_softmax_cu_2cfc26d118softmax_bwd_kernelIfLi12ELi1EEEvPKT_S5_PS3_lif"
LN_FWD = ("_ZN8megabert4cuda46_GLOBAL__N__6a7d62f9_13_layer_norm_cu_8aa0196a21layer_norm_fwd_kernelIN3c108BFloat16E"
          "Li8ELi2EEEvPKT_S7_S7_PS5_PfS9_if")
SAMPLE = f"""\
ptxas info    : 28 bytes gmem, 224 bytes cmem[4]
ptxas info    : Compiling entry function '{SOFTMAX_BWD}' for 'sm_80'
ptxas info    : Function properties for {SOFTMAX_BWD}
    104 bytes stack frame, 104 bytes spill stores, 104 bytes spill loads
ptxas info    : Used 255 registers, used 0 barriers, 104 bytes cumulative stack size, 392 bytes cmem[0]
ptxas info    : Compile time = 350.517 ms
ptxas info    : Compiling entry function '{LN_FWD}' for 'sm_80'
ptxas info    : Function properties for {LN_FWD}
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 39 registers, used 1 barriers, 384 bytes smem, 412 bytes cmem[0]
ptxas info    : Compiling entry function '{SOFTMAX_BWD}' for 'sm_90'
ptxas info    : Function properties for {SOFTMAX_BWD}
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 190 registers, used 0 barriers
"""


def test_ptxas_output_gives_registers_and_spills_per_kernel_and_arch():
    usages = ptxas_report.parse_ptxas(SAMPLE.splitlines())
    got = {(u.mangled, u.arch): (u.registers, u.spill_stores, u.spill_loads) for u in usages}
    assert got == {(SOFTMAX_BWD, "sm_80"): (255, 104, 104), (LN_FWD, "sm_80"): (39, 0, 0),
                   (SOFTMAX_BWD, "sm_90"): (190, 0, 0)}
    assert [u.spills for u in usages] == [True, False, False]


def test_the_table_names_kernels_by_template_and_shows_each_arch():
    rows = ptxas_report.table(ptxas_report.parse_ptxas(SAMPLE.splitlines())).splitlines()
    assert "sm_80 regs" in rows[0] and "sm_90 regs" in rows[0]
    softmax = next(r for r in rows if "softmax" in r)
    if ptxas_report.shutil.which("c++filt"):  # demangled, namespaces dropped
        assert softmax.split("|")[0].strip() == "softmax_bwd_kernel<float, 12, 1>"
        assert any(r.startswith("layer_norm_fwd_kernel<bf16, 8, 2>") for r in rows)
    assert softmax.split("|")[1].split() == ["255", "104/104"]
    assert softmax.split("|")[2].split() == ["190", "0/0"]


def test_short_names_drop_namespaces_and_parameters():
    name = "megabert::cuda::(anonymous namespace)::softmax_fwd_kernel<c10::Half, 7, 4>(c10::Half const*, float)"
    assert ptxas_report.short_name(name) == "softmax_fwd_kernel<fp16, 7, 4>"


def test_a_cuda_torch_is_lent_to_the_venv_and_a_cpu_one_is_not():
    plain = make_venv.plan_venv("2.13.0+cpu", None, False, ("/usr/lib/site",), True)
    assert not plain.system_site and not plain.parent_site and plain.with_pip
    assert make_venv.plan_venv(None, None, False, (), True).system_site is False
    # The GPU image: python3 is itself a venv holding torch, so its site-packages must be
    # named (--system-site-packages alone would show the base interpreter's only).
    image = make_venv.plan_venv("2.11.0+cu130", "13.0", True, ("/opt/torch/.venv/lib/python3.12/site-packages",),
                                False)
    assert image.system_site and image.parent_site == ("/opt/torch/.venv/lib/python3.12/site-packages",)
    assert not image.with_pip and "torch 2.11.0+cu130" in image.reason
    system = make_venv.plan_venv("2.11.0+cu130", "13.0", False, ("/usr/lib/python3/dist-packages",), True)
    assert system.system_site and system.parent_site == ()


def test_a_venv_made_from_a_venv_sees_the_parent_packages(tmp_path):
    parent_site = tmp_path / "parent-site"
    parent_site.mkdir()
    (parent_site / "lent_pkg.py").write_text("WHERE = 'parent'\n")
    plan = make_venv.VenvPlan(True, (str(parent_site),), False, "test")
    make_venv.create(str(tmp_path / "venv"), plan)
    import subprocess

    out = subprocess.run([str(tmp_path / "venv" / "bin" / "python"), "-c", "import lent_pkg; print(lent_pkg.WHERE)"],
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == "parent"


bench_figures = _tool("bench_figures")
bench_gpu = _tool("bench_gpu")


def test_bench_gpu_stops_at_the_first_gpu_step_with_one_line():
    cpu = {"torch": "2.13.0+cpu", "torch_cuda": None, "cuda_available": False, "cuda_kernels": False}
    problem = bench_gpu.gpu_problem(cpu)
    line = bench_gpu.stop_line(problem, ["install", "versions"], "bench_out")
    assert line.startswith("bench-gpu: no CUDA GPU visible (torch.cuda.is_available() is False")
    assert "everything before this step passed: install, versions" in line and "\n" not in line
    no_gpu = dict(cpu, torch="2.11.0+cu130", torch_cuda="13.0")
    assert "torch 2.11.0+cu130" in bench_gpu.gpu_problem(no_gpu)
    gpu = dict(no_gpu, cuda_available=True, cuda_kernels_error="ImportError: no _cuda")
    assert bench_gpu.gpu_problem(gpu) is None
    assert "ImportError: no _cuda" in bench_gpu.kernels_problem(gpu)
    assert bench_gpu.kernels_problem(dict(gpu, cuda_kernels=True)) is None


def test_bench_figures_read_each_benchmarks_lines():
    assert bench_figures.pytest_counts(["SKIPPED [2] tests/x.py:9: no GPU", "31 passed, 2 skipped in 12.3s"]) == \
        {"passed": 31, "skipped": 2}
    kernels = bench_figures.kernel_times([
        "op        shape               dtype       ours ms        reference ms     softmax(masked_fill) ms",
        "softmax   [8,12,128,128]      bfloat16       0.05 (1.00x)        0.21 ( 4.20x)",
        "                                        fwd    1800 GB/s ( 54%)  bwd    2100 GB/s ( 63%)  of 3350 GB/s peak"])
    assert kernels == [{"op": "softmax", "shape": "[8,12,128,128]", "dtype": "bfloat16", "ours_ms": 0.05,
                        "bandwidth": "fwd    1800 GB/s ( 54%)  bwd    2100 GB/s ( 63%)  of 3350 GB/s peak"}]
    varlen = bench_figures.varlen_attention([
        "data                   dropout  attention      seq/s   TFLOP/s     MFU   vs sdpa",
        "padded, 82.8% real     0.1      varlen         208.2     212.4   21.5%     1.11x",
        "full, 100.0% real      0.0      sdpa            40.0      50.0     n/a     1.00x"])
    assert varlen == [{"data": "padded", "real_tokens": 0.828, "attention_dropout": 0.1, "side": "varlen",
                       "seq_per_s": 208.2, "tflops": 212.4, "mfu": 0.215, "vs_sdpa": 1.11},
                      {"data": "full", "real_tokens": 1.0, "attention_dropout": 0.0, "side": "sdpa",
                       "seq_per_s": 40.0, "tflops": 50.0, "mfu": None, "vs_sdpa": 1.0}]
    mem = bench_figures.memory(["bert-base  single             1        3.21          3.05      1.05      1.00",
                                "bert-base  tp2                2      not run          3.05   not run: needs 2 GPUs"])
    assert mem == [{"model": "bert-base", "layout": "single", "world": 1, "measured_gb": 3.21, "predicted_gb": 3.05,
                    "measured_over_predicted": 1.05}]


def test_cuda_check_shows_diagnostics_not_the_compile_commands():
    cuda_check = _tool("cuda_check")
    log = ["[2/3] /usr/local/cuda-13.0/bin/nvcc -c softmax.cu -Werror all-warnings -Xcompiler -Werror",
           "softmax.cu(101): error: identifier \"kHeld\" is undefined",
           "layer_norm.cu(7): warning #177-D: variable \"x\" was declared but never referenced",
           "bindings.cpp:3:5: error: expected ';'", "FAILED: softmax.o", "ninja: build stopped"]
    assert cuda_check.first_errors(log) == log[1:5]


# ------------------------------------------------------------ bench/gpu_bert_large.py (issue 41)

BENCH = os.path.join(ROOT, "bench")
sys.path.append(BENCH)  # the bench's modules import each other by name, as when run from bench/ (last: no shadowing)


def test_real_token_flops_of_samples_are_the_same_packed_or_padded():
    """MFU counts real tokens only: a batch's FLOPs are its samples', however rows hold them."""
    import numpy as np
    import torch

    from gpu_bert_large import batch_flops
    from megabert.presets import bert_tiny
    from megabert.data.packing import PackingSpec, pack_window
    from megabert.planning.flops import bert_flops_per_sample

    rng = np.random.default_rng(0)
    samples = []
    for n in rng.integers(5, 30, size=12):
        mask = (np.arange(32) < n).astype(np.int64)
        labels = np.where((np.arange(32) % 7 == 1) & (mask == 1), 5, -100)
        samples.append({"input_ids": mask * 9, "token_type_ids": mask * 0, "attention_mask": mask, "labels": labels,
                        "next_sentence_label": np.array(0)})
    spec = PackingSpec(seq_length=32, max_samples_per_row=3, window=12, seed=0, sample_fields=("next_sentence_label",))
    packed = {k: torch.from_numpy(v) for k, v in pack_window(samples, 0, spec).items() if k != "row_samples"}
    padded = {k: torch.from_numpy(np.stack([s[k] for s in samples])) for k in samples[0]}
    cfg = bert_tiny(vocab_size=30522)
    assert len(packed["input_ids"]) < len(samples)
    assert abs(batch_flops(cfg, packed) / batch_flops(cfg, padded) - 1) < 1e-12
    one = {k: v[:1] for k, v in padded.items()}
    n, masked = int(one["attention_mask"].sum()), int((one["labels"] != -100).sum())
    assert batch_flops(cfg, one) == bert_flops_per_sample(cfg, n, masked_tokens=masked)


def test_bert_samples_model_wikipedias_padding_at_seq_512():
    from _bert_samples import bert_samples, real_token_share

    samples = bert_samples(512, 256)
    assert set(samples[0]) == {"input_ids", "token_type_ids", "attention_mask", "labels", "next_sentence_label"}
    assert 0.35 < real_token_share(samples) < 0.6  # Krell et al.: over half of seq 512 is padding


def test_the_bench_runs_end_to_end_on_a_cpu_and_its_figures_parse():
    """The CUDA bench's logic on bert-tiny on a CPU: every side builds, steps, is timed and
    profiled, and every line it prints for summary.json parses."""
    import subprocess

    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=ROOT)
    # Two warm-up steps: the compiled epilogues' side compiles its shape-generic graph at the
    # second token count (dynamic=None), before the count of recompiles starts.
    out = subprocess.run([sys.executable, os.path.join(BENCH, "gpu_bert_large.py"), "--device", "cpu", "--tiny",
                          "--phases", "2", "--rounds", "1", "--warmup", "2", "--profile-steps", "1"],
                         capture_output=True, text=True, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert any(line.startswith("targets (issue 41): MFU >= 45% in both phases, >= 1.8x transformers") for line in lines)
    figures = bench_figures.bert_large(lines)
    rows = {r["side"]: r for r in figures["throughput"]}
    assert set(rows) == {"megabert", "megabert-packed", "megabert-compiled-epilogues", "transformers"}
    assert rows["megabert"]["samples_per_row"] == 1.0 and rows["megabert-packed"]["samples_per_row"] > 1.0
    assert rows["megabert-packed"]["real_token_share"] > rows["megabert"]["real_token_share"]
    assert rows["transformers"]["vs_transformers"] == 1.0 and rows["megabert"]["mfu"] is None  # no peak on a CPU
    assert [b["side"] for b in figures["breakdown"]] == ["megabert", "megabert-packed", "megabert-compiled-epilogues", "transformers"]
    assert all(b["wall_ms"] > 0 and b["gemm_ms"] > 0 for b in figures["breakdown"])
    assert figures["host_syncs"] == [] and "host syncs 2 megabert-packed: n/a (no CUDA device)" in lines
    assert figures["recompiles"] == [{"phase": 2, "graphs_compiled": 0, "graph_breaks": 0,
                                      "mode": "eager"}]
    assert figures["targets"]["2"]["mfu_target_met"] is None


def test_bench_figures_read_the_optimizer_pieces():
    lines = ["piece                    ms  GB moved  at copy bw  share of bw",
             "grad_norm              0.61      1.34        0.33        54.8%",
             "fused AdamW, flat      2.95      9.38        2.31        78.3%",
             "foreach AdamW         14.02       nan         nan         nan%"]
    assert bench_figures.optimizer_pieces(lines) == [
        {"piece": "grad_norm", "ms": 0.61, "gb_moved": 1.34, "bandwidth_share": 0.548},
        {"piece": "fused AdamW, flat", "ms": 2.95, "gb_moved": 9.38, "bandwidth_share": 0.783},
        {"piece": "foreach AdamW", "ms": 14.02, "gb_moved": None, "bandwidth_share": None}]


def test_bench_figures_read_the_bert_large_lines():
    lines = [
        "phase  side                           seq/s  real tok/s real share samples/row   TFLOP/s     MFU  "
        "vs transformers  peak GB",
        "1      megabert                       812.3       88921      85.6%        1.00     201.1   20.3%"
        "            1.25x    12.31",
        "1      megabert-packed               1102.4      134512      97.1%        1.13     472.0   47.7%"
        "            1.89x    14.20",
        "1      transformers                   650.0       71200      85.6%        1.00     160.0   16.2%"
        "            1.00x    20.02",
        "1      megabert-packed-graphs        1502.4      183312      97.1%        1.13     643.3   65.0%"
        "            2.57x    14.90",
        "2      megabert-packed                 30.0       14000      95.0%        2.00       1.0     n/a"
        "              n/a      n/a",
        "  target 1 megabert: MFU 20.3% against 45% (moonshot 55%), 1.25x against 1.8x transformers",
        "1      megabert                      78.80     30.12 38.2%      5.02  6.4%     20.10 25.5%      3.60  4.6%"
        "      2.00  2.5%     17.96 22.8%",
        "host syncs 1 megabert-packed: 2.4 per step (12 in 5 steps after warm-up)",
        "host issue 1 megabert-packed-graphs: 1.3 ms of 41.2 ms a step (3%)",
        "recompiles 1: 0 graphs compiled and 0 graph breaks after warm-up (--compile)"]
    f = bench_figures.bert_large(lines)
    assert f["throughput"][1] == {"phase": 1, "side": "megabert-packed", "seq_per_s": 1102.4,
                                  "real_tokens_per_s": 134512.0, "real_token_share": 0.971, "samples_per_row": 1.13,
                                  "tflops": 472.0, "mfu": 0.477, "vs_transformers": 1.89, "peak_gb": 14.2}
    assert f["throughput"][3]["side"] == "megabert-packed-graphs" and f["throughput"][3]["mfu"] == 0.65
    assert f["throughput"][4]["mfu"] is None and f["throughput"][4]["vs_transformers"] is None
    assert f["breakdown"] == [{"phase": 1, "side": "megabert", "wall_ms": 78.8, "gemm_ms": 30.12, "attention_ms": 5.02,
                               "norm_elementwise_ms": 20.1, "optimizer_ms": 3.6, "other_ms": 2.0, "idle_ms": 17.96}]
    assert f["host_syncs"] == [{"phase": 1, "side": "megabert-packed", "per_step": 2.4, "count": 12, "steps": 5}]
    assert f["host_issue"] == [{"phase": 1, "side": "megabert-packed-graphs", "issue_ms": 1.3, "wall_ms": 41.2}]
    assert f["recompiles"] == [{"phase": 1, "graphs_compiled": 0, "graph_breaks": 0, "mode": "--compile"}]
    assert f["targets"]["1"] == {"side": "megabert-packed-graphs", "mfu": 0.65, "vs_transformers": 2.57,
                                 "mfu_target_met": True, "moonshot_met": True, "ratio_target_met": True}
    assert f["targets"]["2"]["mfu_target_met"] is None and f["targets"]["2"]["ratio_target_met"] is None


# ------------------------------------------------------------ bench/gpu_modernbert.py (issue 42)

def test_modernbert_batches_are_padded_rows_with_30_percent_of_real_tokens_masked():
    from gpu_modernbert import MASK_PROB, NUM_BATCHES, mlm_batches

    batches = mlm_batches(256, 8, 1024)
    again = mlm_batches(256, 8, 1024)  # every side builds from the same seed: the same tokens
    assert len(batches) == NUM_BATCHES and all(
        (a[k] == b[k]).all() for a, b in zip(batches, again) for k in ("input_ids", "attention_mask", "labels"))
    for b in batches:
        mask, labels = b["attention_mask"], b["labels"]
        lengths = mask.sum(1)
        assert (lengths >= 128).all() and (lengths <= 256).all() and (lengths < 256).any()  # some padding
        assert (mask[:, :-1] >= mask[:, 1:]).all()  # padding at the end of a row
        assert ((labels != -100) <= (mask == 1)).all() and (b["input_ids"][mask == 0] == 0).all()
        picked = labels != -100
        assert (labels[picked] == b["input_ids"][picked]).all()
        assert abs(picked.sum().item() / mask.sum().item() - MASK_PROB) < 0.05


def test_the_modernbert_bench_runs_end_to_end_on_a_cpu_and_its_figures_parse():
    """The CUDA bench's logic on modernbert-tiny on a CPU: megabert's side through
    pretrain_bert.py's parse_args/resolve_run/build_pretraining and transformers' sdpa side
    build, step, are timed and profiled, and every line summary.json reads parses."""
    import subprocess

    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, os.path.join(BENCH, "gpu_modernbert.py"), "--device", "cpu", "--tiny",
                          "--rounds", "1", "--warmup", "1", "--profile-steps", "1"],
                         capture_output=True, text=True, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert "seq 256, micro-batch 2 rows, 30% masking" in lines[0]
    f = bench_figures.modernbert(lines)
    rows = {r["side"]: r for r in f["throughput"]}
    assert set(rows) == {"megabert", "transformers-sdpa"}  # no flash_attn here: no fa2 side
    assert f["transformers_attention"] == ["sdpa"] and f["fa2_available"] is False
    assert rows["megabert"]["real_token_share"] == rows["transformers-sdpa"]["real_token_share"]  # the same batches
    assert 0.5 <= rows["megabert"]["real_token_share"] < 1.0
    assert rows["transformers-sdpa"]["vs_transformers_sdpa"] == 1.0 and rows["megabert"]["mfu"] is None  # no peak
    assert f["ratios"] == [{"seq": 256, "against": "transformers-sdpa",
                            "megabert_over": rows["megabert"]["vs_transformers_sdpa"]}]
    assert any(line.startswith("megabert: attention ") for line in lines)
    assert [b["side"] for b in f["breakdown"]] == ["megabert", "transformers-sdpa"]
    assert all(b["wall_ms"] > 0 and b["gemm_ms"] > 0 for b in f["breakdown"])
    assert f["host_syncs"] == [] and "host syncs 256 megabert: n/a (no CUDA device)" in lines
    assert f["recompiles"] == [{"seq": 256, "graphs_compiled": 0, "graph_breaks": 0,
                                "mode": "eager"}]


def test_bench_figures_read_the_modernbert_lines():
    lines = [
        "NVIDIA H100 80GB HBM3 | torch 2.11.0+cu130 | ModernBERT-base bf16 | seq 1024, micro-batch 16 rows, ...",
        "transformers attention: sdpa, flash_attention_2 ran; flash_attention_2 available | transformers 4.57.1",
        "seq    side                           seq/s  real tok/s real share   TFLOP/s     MFU vs transformers-sdpa"
        "  peak GB",
        "1024   megabert                        95.2       73112      74.9%     123.4   12.5%              2."
        "10x    20.11",
        "1024   transformers-sdpa               45.3       34816      74.9%      58.8    5.9%              1."
        "00x    31.50",
        "1024   transformers-fa2                60.0       46080      74.9%      77.9     n/a              1."
        "32x      n/a",
        "ratio 1024 megabert/transformers-sdpa: 2.10x real tokens/s",
        "ratio 1024 megabert/transformers-fa2: 1.59x real tokens/s",
        "1024   megabert                      168.07     90.12 53.6%     10.02  6.0%     30.10 17.9%      3.60  2.1%"
        "      4.00  2.4%     30.23 18.0%",
        "host syncs 1024 megabert: 2.0 per step (10 in 5 steps after warm-up)",
        "recompiles 1024: 0 graphs compiled and 0 graph breaks after warm-up (eager: only the layers' epilogues "
        "compile (CUDA))"]
    f = bench_figures.modernbert(lines)
    assert f["throughput"][0] == {"seq": 1024, "side": "megabert", "seq_per_s": 95.2, "real_tokens_per_s": 73112.0,
                                  "real_token_share": 0.749, "tflops": 123.4, "mfu": 0.125,
                                  "vs_transformers_sdpa": 2.1, "peak_gb": 20.11}
    assert f["throughput"][2]["mfu"] is None and f["throughput"][2]["peak_gb"] is None
    assert f["ratios"] == [{"seq": 1024, "against": "transformers-sdpa", "megabert_over": 2.1},
                           {"seq": 1024, "against": "transformers-fa2", "megabert_over": 1.59}]
    assert f["transformers_attention"] == ["sdpa", "flash_attention_2"] and f["fa2_available"] is True
    assert f["breakdown"] == [{"seq": 1024, "side": "megabert", "wall_ms": 168.07, "gemm_ms": 90.12,
                               "attention_ms": 10.02, "norm_elementwise_ms": 30.1, "optimizer_ms": 3.6,
                               "other_ms": 4.0, "idle_ms": 30.23}]
    assert f["host_syncs"] == [{"seq": 1024, "side": "megabert", "per_step": 2.0, "count": 10, "steps": 5}]
    assert f["recompiles"][0]["graphs_compiled"] == 0
    assert bench_figures.bert_large(lines)["throughput"] == []  # each parser reads its own bench's lines


def test_a_bench_step_past_its_time_limit_is_stopped_and_recorded(tmp_path):
    run = bench_gpu.Run(str(tmp_path))
    child = tmp_path / "child.pid"
    script = ("import subprocess, sys, time; "
              f"p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
              f"open({str(child)!r}, 'w').write(str(p.pid)); print('started', flush=True); time.sleep(60)")
    rc = run.step("slow", [sys.executable, "-c", script], timeout=3)
    assert rc == 124 and run.summary["steps"][0]["exit_code"] == 124
    log = (tmp_path / "slow.log").read_text()
    assert "started" in log and "bench-gpu: slow stopped after its 3 s limit" in log
    import time

    pid = int(child.read_text())  # its child goes with it (a zombie at most, until init reaps it)
    for _ in range(50):  # SIGKILL lands within moments
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().split()[2]
        except FileNotFoundError:
            state = "gone"
        if state in ("gone", "Z"):
            break
        time.sleep(0.1)
    assert state in ("gone", "Z")


def test_every_megabert_side_of_the_bert_large_bench_parses():
    # A side's flags are first parsed on the GPU machine, where a typo would cost the lease.
    import gpu_bert_large as gbl
    from megabert.arguments import parse_args

    for name in gbl.SIDES:
        if name == "transformers":
            continue
        extra = list(gbl.SIDE_FLAGS.get(name, ()))
        packed = ["--pack-sequences"] if name.startswith("megabert-packed") else []
        cfg = parse_args(gbl.model_flags(True) + extra + packed + ["--bf16", "--seq-length", "128",
                                                                   "--data-path", "unused"])
        assert cfg.train.cuda_graphs == ("--cuda-graphs" in extra), name
        assert cfg.model.bf16_residual == name.endswith("bf16res"), name
