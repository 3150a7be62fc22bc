"""Measure a CUDA GPU's kernels where virtual time models them: GEMMs, fused attention, memory-bound kernels, clocks.

    python benchmarks/gpu_kernels.py --out kernels.json [--sustain-s 40] [--smoke]

Runs on a real GPU (torch only: no prism import, so it runs under whatever torch the GPU machine holds) and
writes one JSON document of measured kernel times, the input of ``validation/kernels`` (rows of role ``fit``:
the GEMM efficiency figures of the Hopper profiles are fitted on them, DESIGN.md section 13):

- ``gemm``: every linear of the transformer layers of the corpus models (Llama 3 8B/70B/405B, GPT-3 175B,
  Nemotron-4 15B/340B) at the tensor-parallel sizes and token counts their published layouts use, in the three
  passes a training step runs (forward ``F.linear``, input gradient ``dY @ W``, weight gradient ``dY^T @ X``),
  BF16 and FP8 (``torch._scaled_mm``, E4M3, per-tensor scales, BF16 out: Hopper runs every FP8 GEMM as TN, as
  TransformerEngine does), plus square and skinny shapes; random normal data (zeros run faster: less power);
- ``attention``: ``scaled_dot_product_attention`` forward and backward with the flash and cuDNN backends;
- ``memory``: copies, casts, pointwise ops, norms, softmax, reductions and a fused Adam step, with the bytes each
  reads and writes, so the achieved bandwidth is bytes / time;
- ``sustained``: a large GEMM run back to back for ``--sustain-s`` seconds, its TFLOP/s per second;
- ``clocks``: NVML samples (SM clock, power, temperature, throttle reasons) every 0.25 s through the whole run.

Timing: CUDA events around ``reps`` back-to-back launches (after warm-ups), the median of 3 such batches, per
launch; ``reps`` is chosen so a batch lasts about 25 ms. Inputs that fit the 50 MB L2 stay hot between launches,
as a training step's activations often do; larger ones stream from HBM. ``--smoke`` runs a few tiny cases on any
device (the CPU check of this script).
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

# name: hidden, ffn, heads, kv heads, gated MLP, vocab, [(tp, tokens per micro-batch)] as the published layouts run
MODELS: dict[str, tuple[int, int, int, int, bool, int, list[tuple[int, int]]]] = {
    "llama3-8b": (4096, 14336, 32, 8, True, 128256, [(1, 8192), (1, 4096), (2, 8192)]),
    "llama3-70b": (8192, 28672, 64, 8, True, 128256, [(4, 4096), (8, 8192), (4, 8192)]),
    "llama3.1-405b": (16384, 53248, 128, 8, True, 128256, [(8, 4096)]),
    "gpt3-175b": (12288, 49152, 96, 96, False, 51200, [(8, 2048), (4, 2048)]),
    "nemotron4-15b": (6144, 24576, 48, 8, False, 256000, [(2, 4096), (4, 4096)]),
    "nemotron4-340b": (18432, 73728, 96, 8, False, 256000, [(8, 4096)]),
}


class Clocks:
    """NVML samples in a thread (nothing when pynvml is missing or the device is not CUDA)."""

    def __init__(self, period_s: float = 0.25) -> None:
        self.samples: list[dict[str, Any]] = []
        self.error = ""
        self._stop = threading.Event()
        self._period = period_s
        self._thread: threading.Thread | None = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        except Exception as exc:  # noqa: BLE001 - recorded, not fatal
            self.error = repr(exc)
            return
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        n, h, t0 = self._nvml, self._handle, time.perf_counter()
        while not self._stop.is_set():
            try:
                self.samples.append({
                    "t": round(time.perf_counter() - t0, 3),
                    "sm_mhz": n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_SM),
                    "mem_mhz": n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_MEM),
                    "power_w": n.nvmlDeviceGetPowerUsage(h) / 1000,
                    "temp_c": n.nvmlDeviceGetTemperature(h, n.NVML_TEMPERATURE_GPU),
                    "throttle": int(n.nvmlDeviceGetCurrentClocksThrottleReasons(h)),
                    "label": _LABEL[0],
                })
            except Exception as exc:  # noqa: BLE001
                self.error = repr(exc)
                return
            time.sleep(self._period)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)


_LABEL = ["start"]


def timed(fn: Callable[[], Any], device: torch.device, target_s: float = 0.025) -> float:
    """Seconds per call of `fn`: median of 3 batches of back-to-back calls, after warm-ups."""
    if device.type != "cuda":
        fn()
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    one = max(start.elapsed_time(end) / 1e3, 1e-6)
    reps = max(3, min(200, int(target_s / one)))
    out = []
    for _ in range(3):
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) / 1e3 / reps)
    return statistics.median(out)


def gemm_shapes(smoke: bool) -> list[tuple[str, str, int, int, int]]:
    """(where, pass, m, n, k): the GEMM Y[m, n] = A[m, k] B[k, n] each pass of each linear runs."""
    if smoke:
        return [("smoke", "fwd", 64, 48, 32), ("smoke", "dgrad", 64, 32, 48), ("smoke", "wgrad", 48, 32, 64)]
    shapes: dict[tuple[int, int, int, str], str] = {}
    for name, (h, ffn, heads, kv, gated, vocab, layouts) in MODELS.items():
        hd = h // heads
        for tp, tokens in layouts:
            linears = {"qkv": ((heads + 2 * kv) * hd // tp, h), "proj": (h, heads * hd // tp),
                       "fc1": ((2 if gated else 1) * ffn // tp, h), "fc2": (h, ffn // tp), "logits": (vocab // tp, h)}
            for lin, (n, k) in linears.items():
                where = f"{name} tp{tp} t{tokens} {lin}"
                for pas, mnk in (("fwd", (tokens, n, k)), ("dgrad", (tokens, k, n)), ("wgrad", (n, k, tokens))):
                    shapes.setdefault((*mnk, pas), f"{where} {pas}")
    for s in (512, 1024, 2048, 4096, 6144, 8192, 12288, 16384):
        shapes.setdefault((s, s, s, "fwd"), f"square {s}")
    for m in (16, 64, 256, 1024):
        shapes.setdefault((m, 8192, 8192, "fwd"), f"skinny m{m}")
    return [(where, pas, m, n, k) for (m, n, k, pas), where in shapes.items()]


def measure_gemms(device: torch.device, smoke: bool, fp8: bool) -> list[dict[str, Any]]:
    rows = []
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    for where, pas, m, n, k in gemm_shapes(smoke):
        _LABEL[0] = f"gemm {'fp8' if fp8 else 'bf16'} {where}"
        try:
            if fp8:
                a = torch.randn(m, k, device=device).to(torch.float8_e4m3fn)
                b = torch.randn(n, k, device=device).to(torch.float8_e4m3fn).t()  # column-major [k, n]
                one = torch.ones((), device=device)

                def fn(a=a, b=b, one=one) -> Any:
                    return torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16)
            elif pas == "fwd":  # Y = X W^T, W [n, k] row-major (F.linear)
                x, w = torch.randn(m, k, device=device, dtype=dtype), torch.randn(n, k, device=device, dtype=dtype)

                def fn(x=x, w=w) -> Any:
                    return F.linear(x, w)
            elif pas == "dgrad":  # dX [m, n=k_w] = dY [m, k=n_w] @ W [n_w, k_w]
                dy, w = torch.randn(m, k, device=device, dtype=dtype), torch.randn(k, n, device=device, dtype=dtype)

                def fn(dy=dy, w=w) -> Any:
                    return torch.mm(dy, w)
            else:  # dW [m=n_w, n=k_w] = dY^T [n_w, tokens] @ X [tokens, k_w]
                dy, x = torch.randn(k, m, device=device, dtype=dtype), torch.randn(k, n, device=device, dtype=dtype)

                def fn(dy=dy, x=x) -> Any:
                    return torch.mm(dy.t(), x)
            s = timed(fn, device)
            rows.append({"where": where, "pass": pas, "dtype": "float8_e4m3fn" if fp8 else str(dtype)[6:],
                         "m": m, "n": n, "k": k, "us": round(s * 1e6, 3),
                         "tflops": round(2 * m * n * k / s / 1e12, 2)})
        except Exception as exc:  # noqa: BLE001 - a shape the backend refuses is recorded, the sweep goes on
            rows.append({"where": where, "pass": pas, "fp8": fp8, "m": m, "n": n, "k": k, "error": repr(exc)[:200]})
    return rows


def measure_attention(device: torch.device, smoke: bool) -> list[dict[str, Any]]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    cases = [(1, 2, 64, 32)] if smoke else [
        (1, 32, 8192, 128), (1, 32, 4096, 128), (1, 8, 8192, 128), (1, 16, 4096, 128), (1, 64, 8192, 128),
        (2, 16, 8192, 128), (1, 12, 2048, 128), (1, 48, 4096, 128)]
    backends = [("math", SDPBackend.MATH)] if smoke else [("flash", SDPBackend.FLASH_ATTENTION),
                                                          ("cudnn", SDPBackend.CUDNN_ATTENTION)]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = []
    for b, h, s, d in cases:
        for causal in (True, False):
            for bname, backend in backends:
                _LABEL[0] = f"attention {bname} b{b} h{h} s{s}"
                try:
                    q, k, v = (torch.randn(b, h, s, d, device=device, dtype=dtype, requires_grad=True)
                               for _ in range(3))
                    g = torch.randn(b, h, s, d, device=device, dtype=dtype)
                    with sdpa_kernel([backend]):
                        def fwd(q=q, k=k, v=v, causal=causal) -> Any:
                            with torch.no_grad():
                                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)

                        def bwd(out=out, g=g, q=q, k=k, v=v) -> Any:
                            return torch.autograd.grad(out, (q, k, v), g, retain_graph=True)
                        f, bw = timed(fwd, device), timed(bwd, device)
                    flops = 4 * b * h * s * s * d * (0.5 if causal else 1.0)
                    rows.append({"backend": bname, "causal": causal, "batch": b, "heads": h, "seq": s,
                                 "head_dim": d, "fwd_us": round(f * 1e6, 3), "bwd_us": round(bw * 1e6, 3),
                                 "fwd_tflops": round(flops / f / 1e12, 2),
                                 "bwd_tflops": round(2.5 * flops / bw / 1e12, 2)})
                except Exception as exc:  # noqa: BLE001
                    rows.append({"backend": bname, "causal": causal, "batch": b, "heads": h, "seq": s,
                                 "head_dim": d, "error": repr(exc)[:200]})
    return rows


def measure_memory(device: torch.device, smoke: bool) -> list[dict[str, Any]]:
    sizes = [(64, 48)] if smoke else [(8192, 4096), (8192, 14336 * 2), (4096, 6144), (2048, 12288)]
    bf16 = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = []
    for t, h in sizes:
        n = t * h
        x, y = torch.randn(t, h, device=device, dtype=bf16), torch.randn(t, h, device=device, dtype=bf16)
        w = torch.randn(h, device=device, dtype=bf16)
        acc = torch.randn(t, h, device=device, dtype=torch.float32)
        e = x.element_size()
        half = x[:, : h // 2]
        ops: dict[str, tuple[Callable[[], Any], int]] = {
            "copy": (lambda: x.clone(), 2 * n * e),
            "add": (lambda: x + y, 3 * n * e),
            "mul": (lambda: x * y, 3 * n * e),
            "silu": (lambda: F.silu(x), 2 * n * e),
            "gelu": (lambda: F.gelu(x), 2 * n * e),
            "swiglu_unfused_mul": (lambda: F.silu(half) * half, 3 * n // 2 * e),
            "cast_to_fp32": (lambda: x.float(), n * (e + 4)),
            "main_grad_add_": (lambda: acc.add_(x), n * (4 + e + 4)),
            "rms_norm": (lambda: F.rms_norm(x, (h,), w), 2 * n * e),
            "layer_norm": (lambda: F.layer_norm(x, (h,), w, w), 2 * n * e),
            "softmax": (lambda: torch.softmax(x, -1), 2 * n * e),
            "amax": (lambda: torch.amax(x), n * e),
            "sum_fp32": (lambda: acc.sum(), n * 4),
            "dropout": (lambda: F.dropout(x, 0.1, training=True), 2 * n * e + n),
        }
        if device.type == "cuda":
            ops["to_fp8"] = (lambda: x.to(torch.float8_e4m3fn), n * (e + 1))
        for name, (fn, nbytes) in ops.items():
            _LABEL[0] = f"memory {name} {t}x{h}"
            try:
                s = timed(fn, device)
                rows.append({"op": name, "shape": [t, h], "bytes": nbytes, "us": round(s * 1e6, 3),
                             "gbytes_per_s": round(nbytes / s / 1e9, 1)})
            except Exception as exc:  # noqa: BLE001
                rows.append({"op": name, "shape": [t, h], "error": repr(exc)[:200]})
    # Fused Adam (torch.optim.Adam(fused=True)) over fp32 parameters: reads param, grad, exp_avg, exp_avg_sq,
    # writes param, exp_avg, exp_avg_sq: 28 bytes a parameter.
    numel = 4096 if smoke else 256 * 2**20
    p = torch.nn.Parameter(torch.randn(numel, device=device))
    p.grad = torch.randn_like(p)
    opt = torch.optim.Adam([p], lr=1e-4, fused=device.type == "cuda")
    opt.step()
    _LABEL[0] = "memory fused_adam"
    s = timed(opt.step, device)
    rows.append({"op": "fused_adam", "shape": [numel], "bytes": 28 * numel, "us": round(s * 1e6, 3),
                 "gbytes_per_s": round(28 * numel / s / 1e9, 1)})
    return rows


def measure_sustained(device: torch.device, seconds: float, smoke: bool) -> list[dict[str, Any]]:
    size = 256 if smoke else 8192
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a, b = torch.randn(size, size, device=device, dtype=dtype), torch.randn(size, size, device=device, dtype=dtype)
    out, t0 = [], time.perf_counter()
    _LABEL[0] = f"sustained gemm {size}"
    while time.perf_counter() - t0 < seconds:
        s = timed(lambda: a @ b, device, target_s=0.5)
        out.append({"t": round(time.perf_counter() - t0, 2), "tflops": round(2 * size**3 / s / 1e12, 1)})
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--sustain-s", type=float, default=40.0)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--only", default="gemm,fp8,attention,memory,sustained")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = False
    doc: dict[str, Any] = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if device.type == "cuda"
                           else "cpu", "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        doc.update(sms=props.multi_processor_count, memory_bytes=props.total_memory,
                   cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version())
    clocks = Clocks() if device.type == "cuda" else None
    sections: dict[str, Callable[[], Any]] = {
        "gemm": lambda: measure_gemms(device, args.smoke, fp8=False),
        "fp8": lambda: measure_gemms(device, args.smoke, fp8=True),
        "attention": lambda: measure_attention(device, args.smoke),
        "memory": lambda: measure_memory(device, args.smoke),
        "sustained": lambda: measure_sustained(device, args.sustain_s, args.smoke),
    }
    for name in args.only.split(","):
        t0 = time.perf_counter()
        try:
            doc[name] = sections[name]()
        except Exception as exc:  # noqa: BLE001 - one section's failure keeps the others
            doc[name] = {"error": repr(exc)[:500]}
        doc.setdefault("section_s", {})[name] = round(time.perf_counter() - t0, 1)
        if clocks is not None:
            doc["clocks"], doc["clocks_error"] = clocks.samples, clocks.error
        with open(args.out, "w") as f:
            json.dump(doc, f)
        print(name, doc["section_s"][name], "s", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if clocks is not None:
        clocks.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
