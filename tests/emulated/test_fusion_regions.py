"""Fusion regions on a virtual H100: one kernel of the region's FLOPs and input/output bytes, no intermediates.

Each case runs in a fresh process (the virtual CUDA device library loads before torch) and prints one JSON line.
The kernel model is dgx-h100's roofline through a `KernelTimer` (what `prism run` uses); every expected duration
is that model's answer for the `KernelCost` written out here, so the assertions are exact (``==``): the test checks
what the region hands the model (FLOPs, bytes, class, dtype) and where the clock puts it, and the caching-allocator
model's bytes to the byte.
"""

from __future__ import annotations

import pytest
from children import EPILOGUE, program, run_child, timed_h100_prelude

from prism_plugin.cost.gpu import gpu_spec
from prism_plugin.cost.kernel_models import kernel_model
from prism_plugin.cost.kernels import KernelClass, KernelCost
from prism_plugin.cost.profiles import load_profile

MiB = 1 << 20
LAUNCH = 2.0**-17
N = 4096  # y: (4096, 4096) bf16 = 32 MiB; bias: (4096,) bf16 = 8 KiB

PRELUDE = timed_h100_prelude(LAUNCH, "from prism_plugin.device.fusion import fused") + """\
    stream = vg.shim.current_stream(0).key
    torch.ones(8, 8, device="cuda") @ torch.ones(8, 8, device="cuda")  # this thread's cuBLAS workspace, held from here
    def bias_gelu(bias, y):  # megatron.core.fusions.fused_bias_gelu.bias_gelu
        x = bias + y
        return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))
    def measure(fn, *args):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base, start = torch.cuda.memory_allocated(), clock.host_s
        allocs = torch.cuda.memory_stats()["allocation.all.allocated"]
        result = fn(*args)
        return result, {"allocated": torch.cuda.memory_allocated() - base,
                         "peak": torch.cuda.max_memory_allocated() - base,
                         "mallocs": torch.cuda.memory_stats()["allocation.all.allocated"] - allocs,
                         "start_s": start, "end_s": clock.ends[stream]}
"""


def run(body: str) -> dict:
    return run_child(program(PRELUDE, body, EPILOGUE))


def _roofline_s(cost: KernelCost) -> float:
    return kernel_model("roofline", gpu_spec("h100-sxm"), load_profile("dgx-h100").kernels).duration_s(cost)


def test_bias_gelu_region_is_one_elementwise_kernel_with_no_intermediates(library: None) -> None:
    out = run(f"""
        y = torch.randn({N}, {N}, device="cuda", dtype=torch.bfloat16)
        b = torch.randn({N}, device="cuda", dtype=torch.bfloat16)
        before_s = timer.summary().total_s  # the two randn fills
        z, out["eager"] = measure(bias_gelu, b, y)
        del z
        eager_kernels, out["eager_kernel_s"] = timer.summary(top=50).kernels, timer.summary().total_s - before_s
        z, out["fused"] = measure(fused(bias_gelu), b, y)
        summary = timer.summary(top=50)
        out["kernels"] = summary.kernels - eager_kernels
        out["tally"] = summary.as_dict()["fused"]
    """)
    block = N * N * 2  # one (4096, 4096) bf16 activation: 32 MiB, a multiple of the allocator's 2 MiB rounding
    # eager: x, x*0.5, 0.797*x, 0.0447*x, (.)*x, 1+(.), (.)*(.), tanh, 1+tanh, the product: 10 storages, at most 5
    # alive together (x, x*0.5, 0.797*x, 0.0447*x and its product with x, before 0.0447*x dies)
    assert out["eager"]["mallocs"] == 10 and out["eager"]["peak"] == 5 * block
    # fused: only the output is ever allocated
    assert out["fused"] == {**out["fused"], "allocated": block, "peak": block, "mallocs": 1}
    assert out["eager"]["allocated"] == out["fused"]["allocated"]
    nbytes = 2 * block + N * 2  # reads y and the bias, writes the output; no intermediate moves
    cost = KernelCost(op="fused::bias_gelu", kernel_class=KernelClass.ELEMENTWISE, flops=0, bytes=nbytes,
                      dtype="bfloat16", shape=(N, N))
    assert out["kernels"] == 1
    assert out["tally"] == [{"op": "fused::bias_gelu", "class": "elementwise", "count": 1,
                             "total_s": round(_roofline_s(cost), 12), "flops": 0, "bytes": nbytes}]
    # the stream was idle and the region launched nothing before its end: its kernel starts at the host's time
    assert out["fused"]["end_s"] == out["fused"]["start_s"] + _roofline_s(cost)
    # eager: 10 kernels back to back (each longer than a launch), so the stream ends after the sum of their durations
    eager_s = out["eager"]["end_s"] - out["eager"]["start_s"]
    assert eager_s == pytest.approx(out["eager_kernel_s"], rel=1e-12)
    assert out["fused"]["end_s"] - out["fused"]["start_s"] < eager_s / 5


def test_a_compiled_module_is_one_gemm_region_and_nested_regions_fold(library: None) -> None:
    out = run("""
        class Mlp(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = torch.nn.Linear(1024, 4096, bias=False, dtype=torch.bfloat16)
            def forward(self, x):
                return fused(torch.nn.functional.gelu, "inner")(self.fc(x))
        model = torch.compile(Mlp().cuda())
        out["names"] = [name for name, _ in model.named_parameters()]
        x = torch.randn(2048, 1024, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            y, out["fused"] = measure(model, x)
        out["tally"] = timer.summary().as_dict()["fused"]
    """)
    assert out["names"] == ["_orig_mod.fc.weight"]  # as torch.compile's OptimizedModule names them
    # one kernel: the GEMM and the GeLU (a nested region, folded), named after the module; the GEMM's output is an
    # intermediate: only the (2048, 4096) bf16 result (16 MiB) is allocated
    assert out["fused"]["mallocs"] == 1 and out["fused"]["peak"] == 2048 * 4096 * 2
    flops = 2 * 2048 * 4096 * 1024
    nbytes = 2048 * 1024 * 2 + 4096 * 1024 * 2 + 2048 * 4096 * 2  # x and the weight read, the result written
    cost = KernelCost(op="fused::Mlp", kernel_class=KernelClass.GEMM, flops=flops, bytes=nbytes, dtype="bfloat16",
                      shape=(2048, 4096, 1024))
    assert out["tally"] == [{"op": "fused::Mlp", "class": "gemm", "count": 1, "total_s": round(_roofline_s(cost), 12),
                             "flops": flops, "bytes": nbytes}]


def test_tensors_autograd_saves_survive_the_region(library: None) -> None:
    out = run("""
        x = torch.randn(1024, 1024, device="cuda", requires_grad=True)  # fp32: 4 MiB
        def tanh_scaled(x):
            return torch.tanh(x * 2.0) * 3.0  # tanh saves its output for backward; x * 2.0 saves nothing
        y, out["fused"] = measure(fused(tanh_scaled), x)
        y.sum().backward()
        out["grad"] = list(x.grad.shape)
    """)
    # x * 2.0 is an intermediate; tanh's output (saved) and the result survive: two 4 MiB mallocs at the end
    assert out["fused"]["mallocs"] == 2 and out["fused"]["allocated"] == out["fused"]["peak"] == 2 * 4 * MiB
    assert out["grad"] == [1024, 1024]


def test_megatron_extension_fakes_are_one_kernel_each_and_allocate_only_their_outputs(library: None) -> None:
    out = run("""
        from prism_plugin.adapters.megatron.fused_kernels import extensions
        fakes = extensions()
        total_input = torch.randn(4096, 2048, device="cuda", dtype=torch.bfloat16)  # 16 MiB
        grad_output = torch.randn(4096, 8192, device="cuda", dtype=torch.bfloat16)  # 64 MiB
        main_grad = torch.zeros(8192, 2048, device="cuda")  # fp32: 64 MiB
        _, out["wgrad"] = measure(fakes["fused_weight_gradient_mlp_cuda"].wgrad_gemm_accum_fp32, total_input,
                                  grad_output, main_grad)
        scores = torch.randn(32, 1024, 1024, device="cuda", dtype=torch.bfloat16)  # 64 MiB
        probs, out["softmax"] = measure(fakes["scaled_upper_triang_masked_softmax_cuda"].forward, scores, 0.125)
        grads = torch.randn_like(probs)
        returned, out["softmax_backward"] = measure(fakes["scaled_upper_triang_masked_softmax_cuda"].backward,
                                                    grads, probs, 0.125)
        out["in_place"] = returned is grads
        out["tally"] = {t["op"]: [t["class"], t["count"], t["flops"], t["bytes"]]
                        for t in timer.summary().as_dict()["fused"]}
    """)
    # the wgrad GEMM accumulates into main_grad: nothing is allocated (the bf16 product is the kernel's own)
    assert out["wgrad"] == {**out["wgrad"], "allocated": 0, "peak": 0, "mallocs": 0}
    wgrad_bytes = (4096 * 2048 + 4096 * 8192) * 2 + 2 * 8192 * 2048 * 4  # both operands read, main_grad read+written
    # the softmax: its bf16 output only (the float32 scores, mask and probabilities are the kernel's registers)
    assert out["softmax"] == {**out["softmax"], "allocated": 64 * MiB, "peak": 64 * MiB, "mallocs": 1}
    assert out["softmax_backward"] == {**out["softmax_backward"], "allocated": 0, "peak": 0, "mallocs": 0}
    assert out["in_place"]
    assert out["tally"] == {
        "fused::wgrad_gemm_accum_fp32": ["gemm", 1, 2 * 8192 * 2048 * 4096, wgrad_bytes],
        "fused::scaled_upper_triang_masked_softmax_cuda.forward": ["norm", 1, 0, 2 * 64 * MiB],
        "fused::scaled_upper_triang_masked_softmax_cuda.backward": ["norm", 1, 0, 3 * 64 * MiB]}


def test_a_compiled_scatter_into_an_input_holds_its_functional_copy_while_it_runs(library: None) -> None:
    # Megatron's fused cross-entropy backward (calculate_gradients, a @jit_fuser = torch.compile function) writes
    # grad_2d[arange, target] -= update into the softmax it was given; inductor's code for the functionalized graph
    # computes the index_put into a new buffer of the input's size and copies it back: a transient of 64 MiB here.
    # The same scatter in a CUDA extension's kernel (a region that is not compiled) writes in place.
    out = run("""
        softmax = torch.randn(4096, 4096, device="cuda")  # fp32: 64 MiB
        target = torch.zeros(4096, dtype=torch.long, device="cuda")
        update = torch.ones(4096, device="cuda")
        def gradients(softmax, target, update):
            grad_2d = softmax.view(-1, 4096)
            grad_2d[torch.arange(4096, device="cuda"), target] -= update
            return softmax
        _, out["compiled"] = measure(torch.compile(gradients), softmax, target, update)
        _, out["extension"] = measure(fused(gradients, "extension"), softmax, target, update)
    """)
    # compiled: the copy is freed at the region's end, so only the peak sees it (arange's int64 and the gathered
    # values are intermediates: never allocated)
    assert out["compiled"] == {**out["compiled"], "allocated": 0, "peak": 64 * MiB, "mallocs": 1}
    assert out["extension"] == {**out["extension"], "allocated": 0, "peak": 0, "mallocs": 0}
