"""Data rules for virtual participants: what their contributions make of a result, in place.

Rules (DESIGN.md section 4), for a group of n members of which k are real:
- reduction: each virtual member contributes the mean of the real members' contributions, so
  SUM gives ``sum_real * n / k`` (mirror: ``x * n`` when k == 1), AVG the real mean, MIN/MAX the
  real extreme, PRODUCT ``prod_real * mean_real ** (n - k)``; bitwise ops mirror the first real
  member (lowest group rank). Policy ZEROS: virtual members contribute zeros instead.
- gather-like: a virtual slot is a copy of one fixed real member's block (by position); when shapes
  differ (uneven gathers, all-to-all splits) the block's values are repeated to fill the slot.
- nothing here allocates memory that outlives the call, and the k == 1 paths allocate none at all.

Floating-point note: ``x * n`` is the exact sum of n equal values; a real ring sum of n equal values
can differ from it in the last bit for n > 2. Bit-exact end-to-end replay is the RECORDED policy.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from prism_plugin.config.kinds import DataPolicy

RedOp = dist.ReduceOp.RedOpType

__all__ = ["red_op", "premul_factor", "scale_result", "check_reduce_dtype", "apply_virtual_share", "fill_from",
           "same_memory", "zero_fill"]

# RedOp's members, spelt as torch's type stubs declare them: on ReduceOp (ReduceOp.SUM is ReduceOp.RedOpType.SUM)
_SUPPORTED = {
    dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.PRODUCT, dist.ReduceOp.MIN, dist.ReduceOp.MAX,
    dist.ReduceOp.BAND, dist.ReduceOp.BOR, dist.ReduceOp.BXOR,
}


def red_op(op: object) -> RedOp:
    """The RedOpType of a ReduceOp / RedOpType; refuse ops this backend cannot emulate. NCCL's PREMUL_SUM
    (``dist._make_nccl_premul_sum(factor)``) is a SUM here: `premul_factor` gives the factor its result is scaled
    by (sum of factor x input = factor x sum of inputs, applied to the result so no input is written)."""
    # torch's stub omits ReduceOp.op, the RedOpType property its bindings define
    kind = op.op if type(op) is dist.ReduceOp else op  # type: ignore[attr-defined]
    if kind == dist.ReduceOp.PREMUL_SUM and type(op) is dist.ReduceOp:
        return dist.ReduceOp.SUM
    if kind not in _SUPPORTED:
        raise NotImplementedError(
            f"prism: ReduceOp {kind} is not emulated (custom reduce ops are NCCL-only); "
            "use SUM/AVG/PRODUCT/MIN/MAX/BAND/BOR/BXOR or PREMUL_SUM"
        )
    return kind


def premul_factor(op: object) -> float | torch.Tensor | None:
    """The factor of a PREMUL_SUM ReduceOp (a number, or a one-element tensor), else None.

    >>> premul_factor(dist._make_nccl_premul_sum(0.25)), premul_factor(dist.ReduceOp.SUM)
    (0.25, None)
    """
    if type(op) is dist.ReduceOp and op.op == dist.ReduceOp.PREMUL_SUM:  # type: ignore[attr-defined]
        factor: float | torch.Tensor = op.factor
        return factor
    return None


def scale_result(t: torch.Tensor, factor: float | torch.Tensor) -> None:
    """`t` *= `factor`, in place: a PREMUL_SUM's result."""
    t.mul_(factor)


_BITWISE = {dist.ReduceOp.BAND, dist.ReduceOp.BOR, dist.ReduceOp.BXOR}


def check_reduce_dtype(op: RedOp, t: torch.Tensor) -> None:
    """Refuse a bitwise reduction of a floating tensor, at issue, whatever the group's real count.

    gloo refuses it ("Cannot use ReduceOp.BAND with non-integral dtype") and NCCL has no bitwise
    ops; without this check a group with one real member silently returned the input while a
    group with two real members raised from the inner gloo group.
    """
    if op in _BITWISE and _is_float(t):
        raise TypeError(
            f"prism: ReduceOp.{op.name} needs an integral or bool tensor, got {t.dtype} "
            "(real backends refuse bitwise reductions of floating tensors)"
        )


def _is_float(t: torch.Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


def _scale(t: torch.Tensor, num: int, den: int) -> None:
    """t *= num / den, exact when the ratio is an integer; integer tensors floor."""
    if num == den:
        return
    if num % den == 0:
        t.mul_(num // den)
    elif _is_float(t):
        t.mul_(num).div_(den)
    else:
        t.mul_(num).floor_divide_(den)


def apply_virtual_share(
    t: torch.Tensor,
    op: RedOp,
    n: int,
    k: int,
    policy: DataPolicy,
    real_mean: torch.Tensor | None = None,
    first_real: torch.Tensor | None = None,
) -> None:
    """Turn `t`, the reduction over the k real members, into the reduction over all n members.

    For AVG, `t` must already hold the real members' mean (virtual members do not move it).

    `real_mean` (PRODUCT, k > 1) is the real members' mean; `first_real` (BXOR, k > 1) is the first
    real member's contribution. With k == 1 both are `t` itself and need not be given.
    """
    v = n - k
    if v == 0:
        return
    if t.dtype == torch.bool:
        # bool SUM/MAX/BOR are logical or, PRODUCT/MIN/BAND logical and: duplicates change nothing
        if policy is DataPolicy.ZEROS and op in (dist.ReduceOp.PRODUCT, dist.ReduceOp.MIN, dist.ReduceOp.BAND):
            t.zero_()
        return
    if policy is DataPolicy.ZEROS:
        if op == dist.ReduceOp.AVG:
            _scale(t, k, n)
        elif op in (dist.ReduceOp.PRODUCT, dist.ReduceOp.BAND):
            t.zero_()
        elif op == dist.ReduceOp.MAX:
            t.clamp_(min=0)
        elif op == dist.ReduceOp.MIN:
            t.clamp_(max=0)
        return  # SUM, BOR, BXOR: adding zeros changes nothing
    if op == dist.ReduceOp.SUM:
        _scale(t, n, k)
    elif op == dist.ReduceOp.PRODUCT:
        if k == 1:
            t.pow_(n)
        else:
            assert real_mean is not None
            t.mul_(real_mean.pow_(v))
    elif op == dist.ReduceOp.BXOR:
        if v % 2:
            if k == 1:
                t.zero_()  # x ^ x
            else:
                assert first_real is not None
                t.bitwise_xor_(first_real)
    # MIN, MAX, BAND, BOR: the real extreme / mean of duplicates leaves the result unchanged


def zero_fill(t: torch.Tensor) -> None:
    t.zero_()


def same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `a` and `b` start at the same element of the same storage (what comparing ``data_ptr()`` asks,
    also for fake tensors, which have no data pointer)."""
    return a.untyped_storage()._cdata == b.untyped_storage()._cdata and a.storage_offset() == b.storage_offset()


def fill_from(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Write `src`'s values into `dst` in place: a copy when sizes agree, else repeated/truncated.

    Never allocates beyond views; an empty `src` fills zeros. Shapes may differ (uneven gathers).
    """
    if dst.numel() == 0:
        return
    if (same_memory(src, dst) and src.numel() == dst.numel()
            and src.is_contiguous() and dst.is_contiguous()):
        return  # the source already is the destination (in-place gathers / reduce-scatters)
    if src.numel() == dst.numel():
        dst.copy_(src.reshape(dst.shape) if src.is_contiguous() else src.contiguous().view(dst.shape))
        return
    if src.numel() == 0:
        dst.zero_()
        return
    flat_dst = dst.view(-1)
    flat_src = src.reshape(-1)
    step = flat_src.numel()
    for start in range(0, flat_dst.numel(), step):
        stop = min(start + step, flat_dst.numel())
        flat_dst[start:stop].copy_(flat_src[: stop - start])
