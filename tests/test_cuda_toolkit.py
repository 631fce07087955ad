"""setup.py's CUDA decision (megabert/fused_kernels/cuda_toolkit.py), on fake toolkits:
a wrapper nvcc is followed to its toolkit, an incomplete CUDA_HOME is one line of reason
(the CPU build goes on), and an arch list is set when none is given."""
import os
import stat

from megabert.fused_kernels.cuda_toolkit import DEFAULT_ARCH_LIST, nvcc_target, plan_cuda_build


def _toolkit(root, headers=True):
    os.makedirs(os.path.join(root, "bin"))
    nvcc = os.path.join(root, "bin", "nvcc")
    with open(nvcc, "wb") as f:
        f.write(b"\x7fELF fake nvcc")
    if headers:
        os.makedirs(os.path.join(root, "include"))
        open(os.path.join(root, "include", "cuda_runtime_api.h"), "w").close()
    return str(root)


def _wrapper(path, target):
    with open(path, "w") as f:
        f.write(f'#!/bin/sh\nexec {target} "$@"\n')
    os.chmod(path, os.stat(path).st_mode | stat.S_IEXEC)
    return str(path)


def test_wrapper_nvcc_on_path_leads_to_the_toolkit_it_runs(tmp_path):
    home = _toolkit(tmp_path / "cuda-13.0")
    (tmp_path / "bin").mkdir()
    wrapper = _wrapper(tmp_path / "bin" / "nvcc", os.path.join(home, "bin", "nvcc"))
    assert nvcc_target(wrapper) == os.path.join(home, "bin", "nvcc")
    # torch's own guess (the folder above the wrapper) has no headers: not taken.
    plan = plan_cuda_build({}, "13.0", torch_cuda_home=str(tmp_path), nvcc_on_path=wrapper)
    assert plan.build and plan.cuda_home == home and plan.arch_list == DEFAULT_ARCH_LIST


def test_an_incomplete_cuda_home_is_a_reason_not_a_failed_build(tmp_path):
    broken = _toolkit(tmp_path / "broken", headers=False)
    good = _toolkit(tmp_path / "good")
    plan = plan_cuda_build({"CUDA_HOME": broken}, "13.0", standard_homes=(good,))
    assert not plan.build and "\n" not in plan.reason
    assert f"CUDA_HOME={broken} is not a complete CUDA toolkit" in plan.reason and "cuda_runtime_api.h" in plan.reason
    plan = plan_cuda_build({"CUDA_HOME": "/nonexistent"}, "13.0")
    assert not plan.build and "bin/nvcc" in plan.reason


def test_no_cuda_torch_no_toolkit_or_opt_out_build_the_cpu_kernels_only(tmp_path):
    good = _toolkit(tmp_path / "good")
    assert plan_cuda_build({}, None, standard_homes=(good,)).reason == "this torch has no CUDA (a CPU build)"
    assert not plan_cuda_build({"MEGABERT_NO_CUDA_EXT": "1"}, "13.0", standard_homes=(good,)).build
    none = plan_cuda_build({}, "13.0", torch_cuda_home=str(tmp_path / "nothing"))
    assert not none.build and "set CUDA_HOME" in none.reason


def test_the_users_arch_list_and_cuda_home_win(tmp_path):
    good = _toolkit(tmp_path / "good")
    plan = plan_cuda_build({"CUDA_HOME": good, "TORCH_CUDA_ARCH_LIST": "9.0"}, "13.0")
    assert plan.build and plan.cuda_home == good and plan.arch_list == "9.0"
