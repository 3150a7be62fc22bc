"""Virtual GPUs: an unmodified torch training step on fake ``cuda`` tensors in a CPU-only process.

Each case runs in a fresh process (the virtual CUDA device library must load before torch is imported) and
prints one JSON line; the figures asserted are exact: bytes follow from the tensors' sizes and the caching
allocator's rounding (`prism_plugin.cost.allocator_config.round_size`).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from children import EPILOGUE, program, run_child

from prism_plugin.cost.allocator_config import round_size

MiB = 1 << 20

PRELUDE = """
import json, sys
from prism_plugin.device import cuda_runtime
cuda_runtime.preload()
import torch
from prism_plugin.cost.gpu import gpu_spec
from prism_plugin.device.device import VirtualGpu
out = {}
code = 0
try:
"""


def run(body: str) -> dict:
    return run_child(program(PRELUDE, body, EPILOGUE), allow_error=True)


def test_a_training_step_runs_on_fake_cuda_with_exact_allocated_bytes(library: None) -> None:
    out = run("""
        with VirtualGpu(gpu_spec("h100-sxm"), num_devices=8) as vg:
            dev = torch.cuda.current_device()
            model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024))
            model = model.to(dev)  # Module.to with an int device: fake parameters swapped onto cuda:0
            out["param_device"] = str(next(model.parameters()).device)
            out["after_params"] = [torch.cuda.memory_allocated(), torch.cuda.memory_reserved()]
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            x = torch.randn(64, 1024, device=dev)
            losses = []
            for _ in range(2):
                loss = model(x).float().pow(2).mean()
                loss.backward()  # autograd runs the backward of cuda tensors: the virtual device guard
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
            out["losses"] = losses
            out["finite"] = bool(torch.isfinite(loss).all())
            out["after_step"] = torch.cuda.memory_allocated()
            out["peak"] = torch.cuda.max_memory_allocated()
            out["stats_key"] = torch.cuda.memory_stats()["allocated_bytes.all.current"]
            out["summary"] = vg.summary()
        out["restored"] = torch.cuda.is_available()
    """)
    assert "error" not in out, out["error"]
    assert out["param_device"] == "cuda:0"
    params = [4096 * 1024 * 4, 4096 * 4, 1024 * 4096 * 4, 1024 * 4]
    param_bytes = sum(round_size(b) for b in params)  # 16 MiB + 16 KiB + 16 MiB + 4 KiB
    # reserved: one 16 MiB segment per weight (>= 10 MiB: its own size), one 2 MiB small segment for both biases
    assert out["after_params"] == [param_bytes, 2 * 16 * MiB + 2 * MiB]
    # after the step: parameters + AdamW's exp_avg and exp_avg_sq (cuda, like the params) + x + the 0-dim loss
    # + torch's two cuBLAS workspaces (32 MiB on sm90, held from the first GEMM of the forward's handle and of the
    # autograd thread's); gradients are gone (zero_grad sets them to None); AdamW's step counters stay on the CPU
    assert out["after_step"] == 3 * param_bytes + round_size(64 * 1024 * 4) + round_size(4) + 2 * 32 * MiB
    assert out["stats_key"] == out["after_step"]
    assert out["peak"] > out["after_step"]
    assert out["losses"] == [1.0, 1.0] and out["finite"] is True  # the value policy's finite answers
    device0 = out["summary"]["devices"][0]
    assert device0["peak_allocated_bytes"] == out["peak"]
    assert device0["cublas_workspaces"] == 2 and device0["cublas_workspace_bytes"] == 2 * 32 * MiB
    # + the context; no session: no NCCL buffers
    assert device0["device_total_bytes"] == device0["peak_reserved_bytes"] + 512 * MiB
    assert device0["fits"] is True and 1 in out["summary"]["untouched_devices"]  # listed only by index
    sites = {(s["value"], s["count"]) for s in out["summary"]["values"]["by_site"]}
    assert ("1.0", 2) in sites and ("True", 1) in sites  # loss.item() twice, the isfinite check once
    assert out["restored"] is False  # torch.cuda is the CPU wheel's again after stop()


def test_device_api_answers_from_the_profile_gpu(library: None) -> None:
    out = run("""
        with VirtualGpu(gpu_spec("h100-sxm"), num_devices=8):
            props = torch.cuda.get_device_properties(0)
            out["props"] = [props.name, props.total_memory, props.major, props.minor, props.multi_processor_count]
            out["count"] = torch.cuda.device_count()
            out["int_device"] = str(torch.empty(4, device=0).device)
            out["torch_device"] = str(torch.device(0))
            torch.cuda.set_device(3)
            t = torch.empty(1024, 1024, device=torch.cuda.current_device())
            out["on3"] = [str(t.device), torch.cuda.memory_allocated(3), torch.cuda.memory_allocated(0)]
            with torch.cuda.device(5):
                out["inside"] = torch.cuda.current_device()
            out["after"] = torch.cuda.current_device()
            s = torch.cuda.Stream()
            with torch.cuda.stream(s):
                out["stream"] = torch.cuda.current_stream() == s
            context = torch.cuda.stream(s)  # re-enterable, as torch's StreamContext (Megatron enters one twice)
            with context:
                pass
            with context:
                out["reentered"] = torch.cuda.current_stream() == s
            out["restored"] = torch.cuda.current_stream() != s
            t.record_stream(s)  # a virtual stream, as Megatron's a2a overlap records
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            out["event"] = [e.query(), e.elapsed_time(e)]
            out["generators"] = len(torch.cuda.default_generators)
            torch.cuda.manual_seed(7)
            state = torch.cuda.get_rng_state()
            torch.cuda._lazy_call(lambda: torch.cuda.default_generators[3].set_state(state))
            out["free_total"] = list(torch.cuda.mem_get_info())
    """)
    assert "error" not in out, out["error"]
    assert out["props"] == ["NVIDIA H100 80GB HBM3", 81559 * MiB, 9, 0, 132] and out["count"] == 8
    assert out["int_device"] == "cuda:0" and out["torch_device"] == "cuda:0"
    assert out["on3"] == ["cuda:3", 4 * MiB, 0] and out["inside"] == 5 and out["after"] == 3
    assert out["stream"] is True and out["event"] == [True, 0.0] and out["generators"] == 8
    assert out["reentered"] is True and out["restored"] is True
    free, total = out["free_total"]
    # the current device (3) holds one 20 MiB segment (a 4 MiB request is < 10 MiB) beside the 512 MiB context
    assert total == 81559 * MiB and free == total - 512 * MiB - 20 * MiB


def test_out_of_memory_is_torchs_error_at_the_allocation_that_crosses(library: None) -> None:
    out = run("""
        with VirtualGpu(gpu_spec("h100-sxm")):
            keep = torch.empty(60 * 2**30, dtype=torch.uint8, device="cuda")
            try:
                torch.empty(30 * 2**30, dtype=torch.uint8, device="cuda")
            except torch.OutOfMemoryError as exc:
                out["oom"] = str(exc)
            out["allocated"] = torch.cuda.memory_allocated()
    """)
    assert "error" not in out, out["error"]
    assert out["oom"].startswith("CUDA out of memory. Tried to allocate 30.00 GiB. GPU 0 has a total capacity of "
                                 "79.65 GiB of which 19.15 GiB is free. Of the allocated memory 60.00 GiB is allocated")
    assert out["allocated"] == 60 * 2**30


def test_a_read_with_no_stated_answer_raises_naming_the_call_site(library: None) -> None:
    out = run("""
        with VirtualGpu(gpu_spec("h100-sxm")):
            ids = torch.zeros(8, dtype=torch.long, device="cuda")
            out["n"] = int(ids.sum())
    """)
    assert out["error"].startswith("NoValueError: prism virtual GPU: <string>:")
    assert "reads the value of a torch.int64 tensor" in out["error"]


def test_starting_without_the_device_library_is_refused() -> None:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        import torch
        from prism_plugin.cost.gpu import gpu_spec
        from prism_plugin.device.device import VirtualGpu
        try:
            VirtualGpu(gpu_spec("h100-sxm")).start()
        except RuntimeError as exc:
            print(exc)
    """)], capture_output=True, text=True, timeout=120, env={**os.environ, "PRISM_CACHE_DIR": "/nonexistent"})
    assert "has no virtual CUDA device; start it with `prism run --device virtual-gpu`" in proc.stdout


def test_sdpa_takes_flash_attention_as_on_an_h100(library: None) -> None:
    # bf16 causal GQA attention: torch on an sm90 GPU runs FlashAttention, which keeps the output and the fp32
    # log-sum-exp (b x h x s), not the s x s scores; fp32 has no flash kernel: the math path (scores kept)
    out = run("""
        import torch.nn.functional as F
        with VirtualGpu(gpu_spec("h100-sxm"), num_devices=1) as vg:
            for dtype in (torch.bfloat16, torch.float32):
                q = torch.randn(2, 32, 4096, 64, device="cuda", dtype=dtype, requires_grad=True)
                kv = [torch.randn(2, 8, 4096, 64, device="cuda", dtype=dtype, requires_grad=True) for _ in range(2)]
                before = torch.cuda.memory_allocated()
                o = F.scaled_dot_product_attention(q, *kv, is_causal=True, enable_gqa=True)
                out[str(dtype)] = torch.cuda.memory_allocated() - before
                o.sum().backward()
                out[str(dtype) + " grads"] = [list(t.grad.shape) for t in (q, *kv)]
    """)
    o, lse = 2 * 32 * 4096 * 64 * 2, 2 * 32 * 4096 * 4
    assert out["torch.bfloat16"] == round_size(o) + round_size(lse) + 2 * round_size(8)  # + philox seed, offset
    assert out["torch.float32"] > 2 * 32 * 4096 * 4096 * 4  # the math path keeps the fp32 scores
    assert out["torch.bfloat16 grads"] == [[2, 32, 4096, 64], [2, 8, 4096, 64], [2, 8, 4096, 64]]


def test_a_constant_copied_to_the_host_keeps_its_value_and_an_empty_one_has_none(library: None) -> None:
    """``.cpu()`` of a device constant (a cross-device copy the dispatch mode makes as an ``empty_like`` on the
    host) carries the constant's value; an ``empty_like`` of a constant holds none (uninitialised memory). Before the
    fix, both took ``empty_like`` of the real value: reads returned whatever that memory held, so ZeRO-3 with
    optimizer offload skipped its first step in 6 of 10 runs (an "invalid" gradient norm read from it)."""
    out = run("""
        with VirtualGpu(gpu_spec("h100-sxm")) as vg:
            c = torch.tensor([3.5, -1.0], device="cuda")
            out["host"] = c.cpu()[0].item()
            out["host_bool"] = bool((c.cpu() < 0).any())
            out["empty"] = torch.empty_like(c)[0].item()  # no value: the policy's float answer
            out["constants_read"] = vg.values.summary()["constants_read"]
    """)
    assert out["host"] == 3.5 and out["host_bool"] is True
    assert out["empty"] == 1.0 and out["constants_read"] == 2  # the two host reads; not the empty one


def test_numpy_of_a_host_copy_answers_from_the_value_policy_and_counts(library: None) -> None:
    """``.numpy()`` (TensorBoard's scalars: Megatron's ``writer.add_scalar(key, loss)``) is refused by torch for any
    tensor subclass; a fake host tensor answers as its one-element reads do: a constant's values, the policy's float
    answer per element (counted at the call site), an integer with no answer raises; a GPU tensor and bf16 are
    refused with torch's own errors."""
    out = run("""
        with VirtualGpu(gpu_spec("h100-sxm")) as vg:
            loss = torch.randn(2, 3, device="cuda").sum(0)
            array = loss.detach().cpu().numpy()
            out["loss"] = [array.tolist(), str(array.dtype)]
            out["constant"] = torch.tensor([3.5, -1.0], device="cuda").cpu().numpy().tolist()
            out["reads"] = vg.values.summary()["reads"]
            for name, make in (("gpu", lambda: loss.numpy()), ("bf16", lambda: loss.bfloat16().cpu().numpy()),
                               ("int", lambda: torch.zeros(4, dtype=torch.long, device="cuda").cpu().numpy())):
                try:
                    make()
                except Exception as exc:
                    out[name] = f"{type(exc).__name__}: {exc}"
    """)
    assert "error" not in out, out["error"]
    assert out["loss"] == [[1.0, 1.0, 1.0], "float32"] and out["constant"] == [3.5, -1.0] and out["reads"] == 1
    assert out["gpu"].startswith("TypeError: can't convert cuda:0 device type tensor to numpy")
    assert out["bf16"] == "TypeError: Got unsupported ScalarType BFloat16"
    assert out["int"].startswith("NoValueError: prism virtual GPU: <string>:")
