"""bench/_kernel_breakdown.py: kernel names by kind (whole names as the profiler gives them on
CUDA), the per-step sums and the idle time, on traces made here (no GPU needed)."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.append(os.path.join(ROOT, "bench"))  # as when run from bench/ (last: no shadowing)
import _kernel_breakdown as kb  # noqa: E402


def test_kernel_names_are_classified_by_kind():
    names = {
        "gemm": ["nvjet_tst_128x256_64x4_2x1_v_bz_coopA_TNT",
                 "void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8>(Params)",
                 "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off",
                 "ampere_bf16_s16816gemm_bf16_128x64_ldg8_f2f_stages_64x4_tn",
                 "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>(...)",
                 "triton_tem_fused_mm_0", "aten::addmm", "aten::mm", "aten::bmm"],
        "attention": ["void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4>, true>(Params)",
                      "flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel", "fmha_cutlassF_bf16_aligned_64x64_rf_sm80",
                      "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128",
                      "void megabert::cuda::(anonymous namespace)::softmax_fwd_kernel<float, 7, 4>(float const*)",
                      "megabert::varlen_attention"],
        "norm/elementwise": ["void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16>",
                             "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>",
                             "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda>",
                             "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float>>",
                             "triton_poi_fused_add_gelu_3", "triton_red_fused_native_layer_norm_1",
                             "void at::native::(anonymous namespace)::cunn_SoftMaxForward<8, float>",
                             "void megabert::cuda::layer_norm_fwd_kernel<c10::BFloat16, 8, 2>",
                             "aten::native_layer_norm"],
        "optimizer": ["void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor<float>>",
                      "aten::_fused_adamw_", "aten::_foreach_mul_", "megabert_lamb_update"],
        "other": ["Memcpy DtoD (Device -> Device)", "Memset (Device)", "void at::native::index_select_kernel",
                  "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
                  "aten::copy_"],
    }
    got = {kind: [n for n in group if kb.classify(n) != kind] for kind, group in names.items()}
    assert got == {kind: [] for kind in names}


# Whole names as the profiler gives them on CUDA (torch 2.11, H200): most of PyTorch's elementwise
# kernels are named after a lambda, which the optimizer's "lamb" pattern once matched.
LAMBDA_KERNELS = {
    "norm/elementwise": [
        "void at::native::vectorized_elementwise_kernel<4, at::native::bfloat16_copy_kernel_cuda(at::TensorIt"
        "eratorBase&)"
        "::{lambda(float)#1}, std::array<char*, 2ul> >(int, at::native::bfloat16_copy_kernel_cuda(at::TensorI"
        "teratorBase&)"
        "::{lambda(float)#1}, std::array<char*, 2ul>)",
        "void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl(at::TensorIteratorBase&, "
        "at::native::GeluType)::{lambda()#2}::operator()() const::{lambda()#4}::operator()() const::{lambda(c"
        "10::BFloat16)#1}, "
        "std::array<char*, 2ul> >(int, ...)",
        "void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<at::native::direct_co"
        "py_kernel_cuda("
        "at::TensorIteratorBase&)::{lambda()#3}::operator()() const::{lambda()#7}::operator()() const::{lambd"
        "a(float)#1}>"
        "(at::TensorIteratorBase&, ...)::{lambda(int)#1}>(int, ...)",
        "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<c10::BFloat16, at::native::func_wrapper_"
        "t<c10::BFloat16, "
        "at::native::sum_functor<c10::BFloat16, float, c10::BFloat16>::operator()(at::TensorIterator&)::{lamb"
        "da(float, float)#1}>"
        ", unsigned int, c10::BFloat16, 4, 4> >(...)",
        "void at::native::(anonymous namespace)::GammaBetaBackwardCUDAKernelTemplate<float, float, 32u, 32u, "
        "128u, false, true, "
        "false>(long, long, float const*, float const*, float const*, float const*, float*, float*)",
    ],
    "optimizer": [
        "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
        "FusedOptimizerTensorListMetadata<4>, at::native::(anonymous namespace)::FusedAdamMathFunctor<float, 4, "
        "(at::native::ADAM_MODE)1, false>, double*, double, double, double, double, double, bool, double cons"
        "t*, double const*>(...)",
        "void at::native::(anonymous namespace)::lpnorm_cleanup<float, (at::native::(anonymous namespace)::No"
        "rmType)1, float, "
        "float>(float const*, at::native::(anonymous namespace)::TensorListAddresses, int)",
    ],
    "attention": ["void cudnn::fusion::compute_dot_do_o_specialized<true, 64>(void const*, void const*, float*, int)",
                  "void cudnn::fusion::convert_dq_to_16bits<true>(void const*, void*, unsigned int)"],
}


def test_kernels_named_after_a_lambda_are_not_the_optimizer():
    got = {kind: [n[:60] for n in group if kb.classify(n) != kind] for kind, group in LAMBDA_KERNELS.items()}
    assert got == {kind: [] for kind in LAMBDA_KERNELS}
    events = [kb.Event(name, 0.0, 1000.0) for group in LAMBDA_KERNELS.values() for name in group]
    items = kb.breakdown(events, steps=1, wall_ms=10.0).items
    assert items["optimizer"] == 2.0 and items["casts/copies"] == 2.0 and items["gelu"] == 1.0
    assert items["layernorm"] == 1.0


def _x(name, ts, dur, cat="kernel", tid=7):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": tid}


def test_breakdown_sums_kinds_and_counts_idle_as_wall_less_the_union_of_busy_time():
    trace = {"traceEvents": [
        _x("nvjet_tst_128x256", 0, 40), _x("flash_fwd_kernel", 40, 10),
        _x("multi_tensor_apply_kernel<FusedAdam>", 60, 20, tid=8),  # 10 us overlap with the next on another stream
        _x("vectorized_elementwise_kernel", 70, 20), _x("Memcpy DtoD", 100, 10, cat="gpu_memcpy"),
        _x("aten::mm", 0, 500, cat="cpu_op"), _x("cudaLaunchKernel", 0, 5, cat="cuda_runtime"),
        {"ph": "i", "cat": "kernel", "name": "marker", "ts": 0, "pid": 0, "tid": 7}]}
    events = kb.device_events(trace)
    assert [e.name for e in events] == ["nvjet_tst_128x256", "flash_fwd_kernel", "multi_tensor_apply_kernel<FusedAdam>",
                                        "vectorized_elementwise_kernel", "Memcpy DtoD"]
    b = kb.breakdown(events, steps=2, wall_ms=0.1)  # busy 90 of 2 x 100 us: [0, 50) [60, 90) [100, 110)
    assert b.ms == {"gemm": 0.02, "attention": 0.005, "norm/elementwise": 0.01, "optimizer": 0.01, "other": 0.005}
    assert abs(b.busy_ms - 0.045) < 1e-12 and abs(b.idle_ms - 0.055) < 1e-12
    assert b.top_other == [("Memcpy DtoD", 0.005)]
    assert kb.breakdown(events, steps=1, wall_ms=0.05).idle_ms == 0.0  # never below 0


def test_cpu_operators_count_their_self_time_once_and_the_outermost_make_the_busy_time():
    trace = {"traceEvents": [
        _x("aten::linear", 0, 100, "cpu_op", 1), _x("aten::t", 0, 10, "cpu_op", 1),
        _x("aten::addmm", 10, 80, "cpu_op", 1), _x("aten::copy_", 20, 30, "cpu_op", 1),
        _x("aten::native_layer_norm", 150, 50, "cpu_op", 1),
        _x("aten::_fused_adamw_", 120, 60, "cpu_op", 2)]}  # another thread, overlapping the first
    own, outer = kb.cpu_ops(trace)
    assert sorted((e.name, e.dur_us) for e in own) == [
        ("aten::_fused_adamw_", 60), ("aten::addmm", 50), ("aten::copy_", 30), ("aten::linear", 10),
        ("aten::native_layer_norm", 50), ("aten::t", 10)]
    assert sorted(e.name for e in outer) == ["aten::_fused_adamw_", "aten::linear", "aten::native_layer_norm"]
    b = kb.breakdown(own, steps=1, wall_ms=0.3, busy=outer)
    assert b.ms["gemm"] == 0.05 and b.ms["optimizer"] == 0.06 and b.ms["norm/elementwise"] == 0.05
    assert abs(b.busy_ms - 0.18) < 1e-12 and abs(b.idle_ms - 0.12) < 1e-12  # [0, 100) and [120, 200)
