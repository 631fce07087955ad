"""The GPU tooling that runs without a GPU: the ptxas report of `make cuda-check`
(tools/gpu/ptxas_report.py) on captured nvcc 13.0 output, how `make install` makes its
venv on a GPU image (tools/gpu/make_venv.py), and `make bench-gpu`'s stopping line and
figure parsers (tools/gpu/bench_gpu.py, bench_figures.py)."""
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
    bert = bench_figures.bert_large(["1        megabert          812.3     201.1   20.3%            1.25x",
                                     "2        transformers      100.0      90.0     n/a            1.00x"])
    assert bert[0] == {"phase": 1, "side": "megabert", "seq_per_s": 812.3, "tflops": 201.1, "mfu": 0.203,
                       "vs_transformers": 1.25}
    assert bert[1]["mfu"] is None
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
