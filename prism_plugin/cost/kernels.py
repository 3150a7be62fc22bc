"""Kernel-time models of virtual time: how long one GPU kernel lasts (DESIGN.md section 11).

In virtual-GPU mode each ATen op on a device tensor becomes a kernel on an emulated CUDA stream; its
duration comes from a `KernelModel` applied to the op's `KernelCost` (class, FLOPs, bytes moved, dtype,
problem shape; made by `prism_plugin.device.kernels`). Two models, named in every summary:

- `RooflineModel` (``roofline``): ``max(flops / (peak_flops[dtype] * compute_eff), bytes / (hbm * memory_eff),
  min_kernel)``, with the GPU's datasheet peaks (`prism_plugin.cost.gpu`) and per-class efficiencies from the
  hardware profile's ``kernels:`` section (`KernelEfficiency`). GEMM efficiency depends on the shape through
  wave quantization (`gemm_wave_utilization`).
- `TableModel` (``table``): durations measured on a device, keyed by (op, shape, dtype, device); an exact key
  is used as measured, a near one is scaled from its nearest measured neighbour, a miss falls back to a roofline
  model and is counted per op (`TableModel.misses`): never silently zero.

`kernel_model(name, gpu, profile_section, table_path)` builds one from user input (a `ConfigError` naming the
field and the fix otherwise).

Limitations: a kernel's time does not depend on what else runs (no contention between streams, no L2 reuse
across kernels, no clock throttling); FLOPs are what `torch.utils.flop_counter` counts (fused causal attention:
its unmasked pairs only, see `prism_plugin.device.kernels`); every efficiency figure is an
estimate until calibrated (``fit``, or a `table` recorded on the target GPU); ``defaults_used`` names the ones no
profile set. Non-goals: host launch overhead and stream ordering (the clock's, `runtime.virtual_gpu.clock`);
collectives (`prism_plugin.cost.model`). Pure: stdlib only, no torch.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol

from prism_plugin.config.errors import ConfigError
from prism_plugin.cost.gpu import GpuSpec

__all__ = [
    "KernelClass",
    "KernelCost",
    "KernelEfficiency",
    "KernelModel",
    "RooflineModel",
    "attention_wave_utilization",
    "gemm_wave_utilization",
    "peak_dtype",
]

class KernelClass(StrEnum):
    """What kind of kernel an op launches; each class has its own efficiencies in the profile."""

    GEMM = "gemm"
    """Matrix multiplies and convolutions (tensor cores): mm, addmm, bmm, baddbmm, _scaled_mm, convolution."""
    ATTENTION = "attention"
    """Fused attention, forward and backward: scaled_dot_product_*, flash and memory-efficient attention."""
    NORM = "norm"
    """Normalization and softmax, forward and backward: layer norm, RMS norm, softmax, log_softmax."""
    ELEMENTWISE = "elementwise"
    """Pointwise ops (add, mul, gelu, dropout, casts inside ops): memory-bound."""
    REDUCTION = "reduction"
    """Reductions: sum, mean, amax, norm, var."""
    OPTIMIZER = "optimizer"
    """Multi-tensor kernels: ``_foreach_*`` and fused Adam/AdamW/SGD."""
    MEMCPY = "memcpy"
    """Copies and fills on the device: copy_, _to_copy, cat, clone, fill_, zero_, zeros/ones/full."""
    HOST_COPY = "host_copy"
    """A ``copy_`` between host memory and the GPU (ZeRO-Offload's gradients and parameters): it streams over the
    host link (`prism_plugin.cost.gpu.GpuSpec.pcie_bytes_per_s`), not HBM; its bytes are the bytes moved once."""
    OTHER = "other"
    """Irregular memory access (embedding, index, gather, scatter, sort, topk); never a collective."""


@dataclass(frozen=True, kw_only=True, slots=True)
class KernelCost:
    """What one kernel does, as a kernel model needs it (no values, no torch).

    Example: a bf16 ``mm`` of (4096, 4096) by (4096, 4096) is ``KernelCost(op="aten.mm.default",
    kernel_class=KernelClass.GEMM, flops=2 * 4096**3, bytes=3 * 4096**2 * 2, dtype="bfloat16",
    shape=(4096, 4096, 4096))``.
    """

    op: str
    """The ATen overload, as ``str(func)``: ``aten.mm.default``."""
    kernel_class: KernelClass
    flops: int
    """Floating-point operations (a multiply-add counts 2), from ``torch.utils.flop_counter``; 0 when it has no
    formula for the op (every memory-bound class)."""
    bytes: int
    """Bytes moved: tensor inputs read plus outputs (and in-place arguments) written."""
    dtype: str
    """The compute dtype (torch's name without ``torch.``): ``bfloat16``; ``tf32`` for a float32 GEMM the
    program allows on TF32 tensor cores."""
    shape: tuple[int, ...]
    """The problem's size: GEMM ``(m, n, k)`` or batched ``(b, m, n, k)``; attention ``(batch, heads, seq_q,
    seq_kv, head_dim)``, with a trailing 1 when causal; other classes the largest tensor's shape (``(tensors,
    elements)`` for a foreach op)."""


_FP4_NAMES = ("fp4", "nvfp4", "mxfp4")


def peak_dtype(dtype: str) -> str:
    """The `GpuSpec.peak_flops_per_s` key (`prism_plugin.cost.gpu.PEAK_DTYPES`) a kernel of `dtype` runs at.

    torch's FP8 dtypes (``float8_e4m3fn``, ``float8_e5m2``, what `KernelCost.dtype` holds for an
    ``aten._scaled_mm`` of FP8 operands, and their ``fnuz`` variants) -> float8; ``mxfp8`` -> mxfp8; torch's packed
    FP4 (``float4_e2m1fn_x2``) and the block-scaled FP4 names ``fp4``, ``nvfp4``, ``mxfp4`` -> fp4; integer, bool
    and complex dtypes -> float32 (the CUDA-core rate; an estimate). An ``aten._scaled_mm`` of FP8 operands with
    block scales (MXFP8 through torch) reports its operands' dtype, so it runs at the float8 peak, which Blackwell's
    datasheet gives MXFP8 too.

    >>> peak_dtype("float8_e4m3fn"), peak_dtype("float8_e5m2"), peak_dtype("bfloat16"), peak_dtype("int64")
    ('float8', 'float8', 'bfloat16', 'float32')
    >>> peak_dtype("mxfp8"), peak_dtype("nvfp4"), peak_dtype("float4_e2m1fn_x2")
    ('mxfp8', 'fp4', 'fp4')
    """
    if dtype in ("float64", "float32", "tf32", "bfloat16", "float16", "mxfp8"):
        return dtype
    if dtype.startswith("float8"):
        return "float8"
    if dtype.startswith("float4") or dtype in _FP4_NAMES:
        return "fp4"
    return "float32"


def gemm_wave_utilization(shape: tuple[int, ...], sms: int, tile: tuple[int, int], split_k_min_depth: int) -> float:
    """Fraction of the GPU's SMs a GEMM keeps busy over its waves of output tiles, in (0, 1].

    A GEMM ``(m, n, k)`` (or batched ``(b, m, n, k)``) is cut into ``tiles = b * ceil(m / tm) * ceil(n / tn)``
    output tiles, one per thread block; they run in ``ceil(tiles / sms)`` waves, and the last wave is partly
    empty: utilization ``= tiles / (waves * sms)`` ("wave quantization", NVIDIA Deep Learning Performance
    Guide, *Matrix Multiplication Background*, section "Wave Quantization"). A grid with fewer tiles than SMs
    is split along k (split-K, as cuBLAS/CUTLASS do) into ``s = min(sms // tiles, k // split_k_min_depth)``
    parts (at least 1), so ``tiles * s`` blocks share the waves. Tile size and minimum split depth are profile
    figures (estimates). A shape that is not a GEMM's (empty, e.g. a convolution backward) counts as 1.

    >>> round(gemm_wave_utilization((4096, 4096, 4096), 132, (128, 128), 256), 6)  # 1024 tiles, 8 waves
    0.969697
    >>> gemm_wave_utilization((128, 128, 4096), 132, (128, 128), 256)  # 1 tile split 16-way: 16 / 132
    0.12121212121212122
    """
    if len(shape) == 3:
        batch, (m, n, k) = 1, shape
    elif len(shape) == 4:
        batch, m, n, k = shape
    else:
        return 1.0
    tiles = batch * -(-m // tile[0]) * -(-n // tile[1])
    if tiles <= 0:
        return 1.0
    if tiles < sms:
        tiles *= max(1, min(sms // tiles, k // split_k_min_depth))
    waves = -(-tiles // sms)
    return tiles / (waves * sms)


def attention_wave_utilization(shape: tuple[int, ...], backward: bool, sms: int, block: int = 128) -> float:
    """Fraction of the GPU's SMs a fused attention kernel keeps busy over its waves of thread blocks, in (0, 1].

    Fused attention (cuDNN's, FlashAttention-2/3's) runs one thread block per (batch, head, block of 128 rows):
    query rows in the forward, key rows in the backward, so ``tiles = b * h * ceil(rows / block)`` over
    ``ceil(tiles / sms)`` waves, as `gemm_wave_utilization` (no split along the other sequence). Shapes
    ``(batch, heads, seq_q, seq_kv, head_dim[, causal])``; another shape counts as 1. Measured (this project's H200
    sweep, cuDNN 9.19): 12 heads of 2,048 tokens (192 blocks, two waves on 132 SMs: 0.73) ran causal forward at
    286 TFLOP/s against 526 for 32 heads of 4,096 (1,024 blocks: 0.97).

    >>> round(attention_wave_utilization((1, 12, 2048, 2048, 128, 1), False, 132), 4)
    0.7273
    """
    if len(shape) < 5:
        return 1.0
    tiles = shape[0] * shape[1] * -(-shape[3 if backward else 2] // block)
    if tiles <= 0:
        return 1.0
    return tiles / (-(-tiles // sms) * sms)


# -- efficiencies (the profile's `kernels:` section) ----------------------------------------------------------

_CLASS_DEFAULTS: dict[KernelClass, tuple[float, float]] = {
    # (compute_efficiency, memory_efficiency): estimates for an H100 SXM, to be calibrated.
    KernelClass.GEMM: (0.75, 0.8),  # large bf16 cuBLAS GEMMs: ~700-800 of 989.4 TFLOP/s
    KernelClass.ATTENTION: (0.5, 0.8),  # FlashAttention-2 ~35%, FlashAttention-3 up to 75% of peak (Shah et al. 2024)
    KernelClass.NORM: (0.5, 0.7),  # row-wise kernels: two passes over short rows
    KernelClass.ELEMENTWISE: (0.5, 0.85),  # large vectorized pointwise kernels: ~2.8 of 3.35 TB/s
    KernelClass.REDUCTION: (0.5, 0.8),
    KernelClass.OPTIMIZER: (0.5, 0.75),  # multi_tensor_apply over many small tensors
    KernelClass.MEMCPY: (0.5, 0.85),  # device-to-device copy: read + write near HBM peak
    KernelClass.HOST_COPY: (0.5, 0.8),  # pinned host <-> device copies: ~50 of 64 GB/s over PCIe Gen5 x16
    KernelClass.OTHER: (0.5, 0.5),  # gathers and scatters: irregular access
}
_DEFAULTS: dict[str, Any] = {
    "min_kernel_us": 2.5,  # the smallest kernels of an H100 training step's trace last ~2-3 us; estimate
    # host time per launch (the framework's Python, PyTorch's dispatcher, cudaLaunchKernel): dgx-h100's figure, fitted
    # on Megatron-LM's H100 functional tests (prism_plugin/cost/profiles/dgx-h100.yaml). The host clock advances by it
    # per launch.
    "launch_overhead_us": 86.2,
    # host time of a launch after the first inside one call into a compiled extension (TE's C++ launch loops): the
    # driver's cudaLaunchKernel alone, a few us on a modern host; estimate
    "native_launch_us": 5.0,
    "gemm_tile": (128, 128),  # a common cuBLAS/CUTLASS CTA tile; estimate (Hopper kernels also use 128x256)
    "gemm_split_k_min_depth": 256,  # k per split-K part; estimate
    **{f"{cls.value}.compute_efficiency": c for cls, (c, _) in _CLASS_DEFAULTS.items()},
    **{f"{cls.value}.memory_efficiency": m for cls, (_, m) in _CLASS_DEFAULTS.items()},
    # fused attention's shape (`attention_factor`): neutral unless a profile sets them
    "attention.seq_half": 0.0,
    "attention.backward_factor": 1.0,
    "attention.full_factor": 1.0,
    # a GEMM's shape and dtype (`gemm_factor`): neutral unless a profile sets them
    "gemm.k_half": 0.0,
    "gemm.float8_factor": 1.0,
}
_CLASS_FIELDS = ("compute_efficiency", "memory_efficiency")
_ATTENTION_FIELDS = ("seq_half", "backward_factor", "full_factor")
"""The attention class's own fields besides `_CLASS_FIELDS`."""
_GEMM_FIELDS = ("k_half", "float8_factor")
"""The GEMM class's own fields besides `_CLASS_FIELDS`."""
_TOP_FIELDS = ("min_kernel_us", "launch_overhead_us", "native_launch_us", "gemm_tile", "gemm_split_k_min_depth",
               *(c.value for c in KernelClass))


def _unknown(key: str, known: tuple[str, ...] | list[str], prefix: str, where: str,
             error: type[ConfigError]) -> ConfigError:
    close = difflib.get_close_matches(key, known, n=1) or [k for k in known if k.startswith(key)][:1]
    hint = f"did you mean `{prefix}{close[0]}`?" if close else f"known fields: {', '.join(known)}"
    return error(f"{where}unknown field `{prefix}{key}`; {hint}")


def _checked(key: str, value: Any, where: str, error: type[ConfigError]) -> Any:
    """`value` of dotted `key` validated (and normalised: floats, a tuple tile), else `error` naming it."""
    field = f"{where}`kernels.{key}`"
    if key == "gemm_tile":
        if (not isinstance(value, list | tuple) or len(value) != 2
                or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in value)):
            raise error(f"{field} must be two positive integers (rows, columns of a GEMM output tile), e.g. [128, 128]")
        return (value[0], value[1])
    if key == "gemm_split_k_min_depth":
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise error(f"{field} must be a positive integer (k per split-K part), e.g. 256; got {value!r}")
        return value
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise error(f"{field} must be a finite number, got {value!r}; e.g. {_DEFAULTS[key]}")
    if key == "attention.seq_half":
        if value < 0:
            raise error(f"{field} must be >= 0 (the key length at which attention reaches half its efficiency), "
                        f"got {value!r}; e.g. 270")
        return float(value)
    if key == "gemm.k_half":
        if value < 0:
            raise error(f"{field} must be >= 0 (the inner dimension at which a GEMM reaches half its efficiency), "
                        f"got {value!r}; e.g. 200")
        return float(value)
    if key in ("attention.backward_factor", "attention.full_factor", "gemm.float8_factor"):
        if value <= 0:
            raise error(f"{field} must be > 0 (a ratio of efficiencies), got {value!r}; e.g. 0.65")
        return float(value)
    if key in ("launch_overhead_us", "native_launch_us"):
        if value < 0:
            raise error(f"{field} must be >= 0 microseconds of host time per kernel launch, got {value!r}; e.g. 5")
    elif key == "min_kernel_us":
        if value <= 0:
            raise error(f"{field} must be > 0 microseconds (every kernel takes time), got {value!r}; e.g. 2.5")
    elif not 0 < value <= 1:
        raise error(f"{field} must be a fraction in (0, 1], got {value!r}; e.g. 0.8 for 80% of peak")
    return float(value)


@dataclass(frozen=True, slots=True)
class KernelEfficiency:
    """The profile's ``kernels:`` section: achieved fractions of peak per kernel class, GEMM tiling, kernel floor.

    Only what the profile sets is kept (`given`, dotted keys such as ``gemm.compute_efficiency``); every other
    figure is this module's policy default, listed by `defaults_used` so summaries can say which figures no
    profile set. YAML (every key optional)::

        kernels:
          min_kernel_us: 2.5
          launch_overhead_us: 86.2
          native_launch_us: 5.0
          gemm_tile: [128, 128]
          gemm_split_k_min_depth: 256
          gemm: {compute_efficiency: 0.75, memory_efficiency: 0.8}
          attention: {compute_efficiency: 0.6, seq_half: 270, backward_factor: 0.65, full_factor: 1.17}
          norm: {memory_efficiency: 0.7}

    Example: ``KernelEfficiency.from_mapping({"gemm": {"compute_efficiency": 0.7}}).compute_efficiency(
    KernelClass.GEMM) == 0.7``, and ``"gemm.compute_efficiency" not in`` its `defaults_used`.
    """

    given: tuple[tuple[str, Any], ...] = ()
    """(dotted key, value) pairs the profile set, sorted; validated at construction."""

    def __post_init__(self) -> None:
        pairs = self.given.items() if isinstance(self.given, Mapping) else self.given
        out = {}
        for key, value in pairs:
            if key not in _DEFAULTS:
                raise _unknown(key, list(_DEFAULTS), "kernels.", "", ConfigError)
            out[key] = _checked(key, value, "", ConfigError)
        object.__setattr__(self, "given", tuple(sorted(out.items())))

    @classmethod
    def from_mapping(cls, data: object, *, where: str = "", error: type[ConfigError] = ConfigError
                     ) -> KernelEfficiency:
        """Parse the nested YAML mapping of a ``kernels:`` section (None: all defaults); `where` prefixes
        messages (a file name), `error` is the `ConfigError` subclass raised."""
        where = f"{where}: " if where else ""
        if data is None:
            return cls()
        if not isinstance(data, Mapping):
            raise error(f"{where}`kernels` must be a mapping, e.g. {{min_kernel_us: 2.5, gemm: "
                        f"{{compute_efficiency: 0.75}}}}; got {data!r}")
        flat: dict[str, Any] = {}
        for key, value in data.items():
            key = str(key)
            if key not in _TOP_FIELDS:
                raise _unknown(key, _TOP_FIELDS, "kernels.", where, error)
            if key in _DEFAULTS:
                flat[key] = _checked(key, value, where, error)
                continue
            if not isinstance(value, Mapping):
                raise error(f"{where}`kernels.{key}` must be a mapping of {' and '.join(_CLASS_FIELDS)}, "
                            f"e.g. {{memory_efficiency: 0.8}}; got {value!r}")
            fields = (*_CLASS_FIELDS, *{KernelClass.ATTENTION.value: _ATTENTION_FIELDS,
                                        KernelClass.GEMM.value: _GEMM_FIELDS}.get(key, ()))
            for sub, figure in value.items():
                if str(sub) not in fields:
                    raise _unknown(str(sub), fields, f"kernels.{key}.", where, error)
                flat[f"{key}.{sub}"] = _checked(f"{key}.{sub}", figure, where, error)
        return cls(tuple(flat.items()))

    def to_mapping(self) -> dict[str, Any]:
        """The given figures as nested YAML data (empty when the profile set none); `from_mapping` reads it back."""
        out: dict[str, Any] = {}
        for key, value in self.given:
            head, _, sub = key.partition(".")
            if sub:
                out.setdefault(head, {})[sub] = value
            else:
                out[key] = list(value) if isinstance(value, tuple) else value
        return out

    def value(self, key: str) -> Any:
        """The figure of dotted `key`: the profile's, else the policy default."""
        for given_key, value in self.given:
            if given_key == key:
                return value
        return _DEFAULTS[key]

    @property
    def defaults_used(self) -> tuple[str, ...]:
        """Dotted keys no profile set, whose policy default is in use (report them with the model's figures)."""
        given = {key for key, _ in self.given}
        return tuple(key for key in _DEFAULTS if key not in given)

    @property
    def launch_overhead_s(self) -> float:
        """Host seconds per kernel launch (the virtual-time host clock's step per launch)."""
        return 1e-6 * float(self.value("launch_overhead_us"))

    @property
    def native_launch_s(self) -> float:
        """Host seconds of each launch after the first in one compiled-extension call (`VirtualTime.native_call`)."""
        return 1e-6 * float(self.value("native_launch_us"))

    def compute_efficiency(self, kernel_class: KernelClass) -> float:
        """Achieved fraction of the dtype's peak FLOP/s (for GEMMs: before wave quantization)."""
        return self.value(f"{kernel_class.value}.compute_efficiency")

    def memory_efficiency(self, kernel_class: KernelClass) -> float:
        """Achieved fraction of the HBM bandwidth."""
        return self.value(f"{kernel_class.value}.memory_efficiency")

    def attention_factor(self, cost: KernelCost) -> float:
        """A fused attention kernel's efficiency relative to ``attention.compute_efficiency``, from its shape.

        ``compute_efficiency`` is causal forward attention's at long keys; a backward kernel (an op named
        ``*backward*`` or ``*bwd*``) runs at ``backward_factor`` of it, full (non-causal) attention at
        ``full_factor``, and both saturate in the key length ``s`` as ``s / (s + seq_half)`` (each thread block's
        fixed prologue and epilogue against its loop over the keys). FLOPs are torch's (`flop_counter`: a backward is
        twice its forward's 4 matmuls, no recompute; a causal kernel counts its unmasked pairs). Shapes
        ``(batch, heads, seq_q, seq_kv, head_dim[, 1 if causal])``; another shape only gets the direction and mask
        factors. The head dimension does not enter (the profile's figures are for 128).

        >>> eff = KernelEfficiency.from_mapping({"attention": {"seq_half": 256, "backward_factor": 0.5}})
        >>> eff.attention_factor(KernelCost(op="prism_te.fused_attn_bwd.default", kernel_class=KernelClass.ATTENTION,
        ...     flops=1, bytes=1, dtype="bfloat16", shape=(1, 8, 768, 768, 128, 1)))
        0.375
        """
        backward = "backward" in cost.op or "bwd" in cost.op
        causal = len(cost.shape) == 6 and cost.shape[5] == 1
        factor = (self.value("attention.backward_factor") if backward else 1.0) * (
            1.0 if causal else self.value("attention.full_factor"))
        if len(cost.shape) >= 4 and cost.shape[3] > 0:
            seq = cost.shape[3]
            factor *= seq / (seq + self.value("attention.seq_half"))
        return factor

    def gemm_factor(self, cost: KernelCost) -> float:
        """A GEMM's efficiency relative to ``gemm.compute_efficiency`` (before wave quantization), from its dtype
        and shape.

        An FP8 GEMM (the float8 and mxfp8 peaks) runs at ``float8_factor`` of the efficiency a BF16 one reaches of
        its own peak (its tiles finish twice as fast, so their fixed prologue, epilogue and scaling weigh more),
        and every GEMM saturates in its inner dimension ``k`` as ``k / (k + k_half)`` (each tile loads and stores
        its output once, however deep its loop over k). Shapes ``(m, n, k)`` or ``(b, m, n, k)``; another shape
        (a convolution backward's empty one) gets the dtype factor only.

        >>> eff = KernelEfficiency.from_mapping({"gemm": {"k_half": 256, "float8_factor": 0.9}})
        >>> eff.gemm_factor(KernelCost(op="aten._scaled_mm.default", kernel_class=KernelClass.GEMM, flops=1,
        ...     bytes=1, dtype="float8_e4m3fn", shape=(8192, 8192, 768)))
        0.675
        """
        factor = self.value("gemm.float8_factor") if peak_dtype(cost.dtype) in ("float8", "mxfp8") else 1.0
        if len(cost.shape) in (3, 4) and cost.shape[-1] > 0:
            k = cost.shape[-1]
            factor *= k / (k + self.value("gemm.k_half"))
        return factor


# -- models ---------------------------------------------------------------------------------------------------


class KernelModel(Protocol):
    """A kernel-time model: `name` (named in every summary) and a deterministic `duration_s`."""

    @property
    def name(self) -> str: ...

    def duration_s(self, cost: KernelCost) -> float:
        """The kernel's modelled duration in seconds, > 0."""
        ...


class RooflineModel:
    """``duration = max(flops / achieved_flops, bytes / achieved_bandwidth, min_kernel)`` on one GPU.

    ``achieved_flops = peak_flops_per_s[peak_dtype(dtype)] * compute_efficiency(class)``, times
    `gemm_wave_utilization` and `KernelEfficiency.gemm_factor` for a GEMM, `KernelEfficiency.attention_factor` and
    `attention_wave_utilization` for fused attention;
    ``achieved_bandwidth = hbm_bytes_per_s * memory_efficiency(class)`` (``pcie_bytes_per_s`` for a host copy)
    (the roofline: Williams, Waterman, Patterson, CACM 2009). Pure arithmetic, deterministic.

    Example (an H100 with compute efficiency 0.75 and no k_half): a 4096^3 bf16 mm does 2 * 4096^3 =
    137,438,953,472 FLOPs at 989.4e12 * 0.75 * 1024/1056 = 7.1956e14 FLOP/s -> 191.0 us; its 100,663,296 bytes at
    3.35e12 * 0.8 would take 37.6 us, so it is compute-bound.
    """

    name = "roofline"

    def __init__(self, gpu: GpuSpec, efficiency: KernelEfficiency | None = None) -> None:
        if not gpu.peak_flops_per_s or gpu.hbm_bytes_per_s <= 0:
            raise ConfigError(
                f"gpu {gpu.name!r} has no peak_flops_per_s / hbm_bytes_per_s: the roofline kernel model needs "
                "both; use a built-in GPU (prism_plugin.cost.gpu.GPUS) or give its datasheet figures"
            )
        self.gpu = gpu
        self.efficiency = efficiency if efficiency is not None else KernelEfficiency()
        eff = self.efficiency
        self._floor_s = eff.value("min_kernel_us") / 1e6
        self._tile = eff.value("gemm_tile")
        self._split = eff.value("gemm_split_k_min_depth")
        self._compute = {cls: eff.compute_efficiency(cls) for cls in KernelClass}
        fastest = self._compute[KernelClass.ATTENTION] * max(1.0, eff.value("attention.backward_factor")) * max(
            1.0, eff.value("attention.full_factor"))
        if fastest > 1:
            raise ConfigError(f"kernels.attention: compute_efficiency x backward_factor x full_factor reaches "
                              f"{fastest:.3g} of peak; an attention kernel runs at most at peak: lower them")
        if self._compute[KernelClass.GEMM] * max(1.0, eff.value("gemm.float8_factor")) > 1:
            raise ConfigError("kernels.gemm: compute_efficiency x float8_factor exceeds 1: an FP8 GEMM runs at most "
                              "at the FP8 peak; lower them")
        self._bandwidth = {cls: (gpu.pcie_bytes_per_s if cls is KernelClass.HOST_COPY else gpu.hbm_bytes_per_s)
                           * eff.memory_efficiency(cls) for cls in KernelClass}

    def _peak(self, dtype: str) -> float:
        key = peak_dtype(dtype)
        try:
            return self.gpu.peak_flops_per_s[key]
        except KeyError:
            raise ConfigError(
                f"gpu {self.gpu.name!r} has no {key} peak (peak_flops_per_s has {sorted(self.gpu.peak_flops_per_s)}):"
                f" the program runs {dtype} kernels this GPU does not have; emulate a GPU that has them"
            ) from None

    def achieved_flops_per_s(self, cost: KernelCost) -> float:
        """The FLOP/s this kernel runs at (the compute roof it meets)."""
        rate = self._peak(cost.dtype) * self._compute[cost.kernel_class]
        if cost.kernel_class is KernelClass.GEMM:
            rate *= gemm_wave_utilization(cost.shape, self.gpu.multi_processor_count, self._tile,
                                          self._split) * self.efficiency.gemm_factor(cost)
        elif cost.kernel_class is KernelClass.ATTENTION:
            rate *= self.efficiency.attention_factor(cost) * attention_wave_utilization(
                cost.shape, "backward" in cost.op or "bwd" in cost.op, self.gpu.multi_processor_count)
        return rate

    def duration_s(self, cost: KernelCost) -> float:
        compute_s = cost.flops / self.achieved_flops_per_s(cost) if cost.flops else 0.0
        bandwidth = self._bandwidth[cost.kernel_class]
        if not bandwidth > 0:  # a host copy on a GPU whose host link the spec does not give
            raise ConfigError(f"gpu {self.gpu.name!r} has no pcie_bytes_per_s: a copy between host and device "
                              "needs the GPU's host-link bandwidth; give its datasheet figure")
        memory_s = cost.bytes / bandwidth
        return max(compute_s, memory_s, self._floor_s)
