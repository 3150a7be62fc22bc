"""A synthetic Megatron-style job: TP x PP (1F1B) x DP, as an execution graph with one class per stage.

What each stage's trace holds, in Megatron-core's order (`forward_backward_pipelining_without_interleaving`):

- forward / backward pass of one micro-batch: compute split into `tp_collectives_per_pass` chunks, each
  followed by a blocking all-reduce of `activation_bytes` on the "tp" group (the row-parallel all-reduces
  after attention and MLP, without sequence parallelism); with tp=1 one compute span and no collective;
- pipeline transfers of `activation_bytes` along "pp": single transfers are blocking, the paired ones of the
  steady state (`send_forward_recv_backward`, `send_backward_recv_forward`) are issued together as async
  ops and then waited on, as `batch_isend_irecv` does; the first stage receives no activations and the last
  sends none;
- the 1F1B schedule: warm-up (forward passes only), steady state (one forward, one backward), cool-down
  (backward passes only);
- the data-parallel gradient sync on "dp": an all-reduce of `grad_bytes`, or a reduce-scatter of
  `grad_bytes` then (after the optimizer step) an all-gather of `grad_bytes` (distributed optimizer);
  then `optimizer_us` of compute.

Non-goals: interleaved (virtual) pipeline stages, sequence/context/expert parallelism, overlap of the
gradient sync with backward; the synthetic job is a workload for the replay, not a model of any network.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import cast

from prism_plugin.config.errors import int_at_least, positive_int
from prism_plugin.config.kinds import OpKind
from prism_plugin.graph.build import TraceBuilder
from prism_plugin.graph.errors import GraphError
from prism_plugin.graph.schema import ExecutionGraph, WorldLayout
from prism_plugin.topology import MegatronLayout

__all__ = ["GradSync", "SyntheticJob", "build_1f1b_graph"]


class GradSync(StrEnum):
    """How the data-parallel replicas combine gradients at the end of the iteration."""

    ALL_REDUCE = "all_reduce"
    REDUCE_SCATTER_ALL_GATHER = "reduce_scatter_all_gather"  # distributed optimizer / ZeRO-1


def _per_stage(name: str, value: float | Sequence[float], pp: int) -> tuple[float, ...]:
    values = (value,) * pp if isinstance(value, int | float) else tuple(value)
    if len(values) != pp:
        raise GraphError(
            f"{name} has {len(values)} entries for pp={pp} stages: give one per stage or a number"
        )
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int | float) or not v >= 0:
            raise GraphError(f"{name} entries must be numbers >= 0 (microseconds), got {v!r}")
    return tuple(float(v) for v in values)


@dataclass(frozen=True, kw_only=True, slots=True)
class SyntheticJob:
    """Parameters of the synthetic 1F1B job; world_size = tp * pp * dp.

    Example: ``SyntheticJob(tp=8, pp=16, dp=64, num_microbatches=64, fwd_us=1000, bwd_us=2000,
    activation_bytes=2**26, grad_bytes=2**30)`` is an 8192-rank job.
    """

    tp: int
    """Tensor-parallel size."""
    pp: int
    """Pipeline-parallel size (number of stages = number of classes)."""
    dp: int
    """Data-parallel size (number of replicas)."""
    num_microbatches: int
    """Micro-batches per iteration and replica."""
    fwd_us: float | Sequence[float]
    """Forward compute time of one micro-batch on one stage, in microseconds (a number or one per stage)."""
    bwd_us: float | Sequence[float]
    """Backward compute time of one micro-batch on one stage, in microseconds (a number or one per stage)."""
    activation_bytes: int
    """Bytes of one activation (and activation gradient) between stages; also each TP all-reduce's size."""
    grad_bytes: int
    """Bytes of this rank's gradients synchronised across data-parallel replicas."""
    grad_sync: GradSync = GradSync.ALL_REDUCE
    """All-reduce, or reduce-scatter + all-gather (distributed optimizer)."""
    tp_collectives_per_pass: int = 2
    """TP all-reduces per forward and per backward pass (2 = attention + MLP of one layer block)."""
    optimizer_us: float = 0.0
    """Optimizer step compute after the gradient sync, in microseconds."""
    order: str = "tp-cp-ep-dp-pp"
    """Megatron's rank order, fastest axis first ("tp-cp-ep-pp-dp" = --use-tp-pp-dp-mapping)."""

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "num_microbatches", "tp_collectives_per_pass"):
            positive_int(name, getattr(self, name), hint="an int >= 1", error=GraphError)
        for name in ("activation_bytes", "grad_bytes"):
            int_at_least(name, getattr(self, name), 0, hint="bytes", error=GraphError)
        object.__setattr__(self, "fwd_us", _per_stage("fwd_us", self.fwd_us, self.pp))
        object.__setattr__(self, "bwd_us", _per_stage("bwd_us", self.bwd_us, self.pp))
        object.__setattr__(self, "grad_sync", GradSync(self.grad_sync))
        if not (isinstance(self.optimizer_us, int | float) and self.optimizer_us >= 0):
            raise GraphError(f"optimizer_us={self.optimizer_us!r} must be a number >= 0")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp


def _stage_trace(job: SyntheticJob, stage: int) -> TraceBuilder:
    """The trace of pipeline stage `stage`: 1F1B over `num_microbatches`, then the gradient sync."""
    b = TraceBuilder(axis_sizes={"pp": job.pp})
    first, last = stage == 0, stage == job.pp - 1
    m, act = job.num_microbatches, job.activation_bytes
    # per-stage tuples: `SyntheticJob.__post_init__` made them so
    fwd_us, bwd_us = cast(tuple[float, ...], job.fwd_us)[stage], cast(tuple[float, ...], job.bwd_us)[stage]

    def run_pass(what: str, mb: int, duration_us: float) -> None:
        if job.tp == 1:
            b.compute(duration_us, name=f"{what} mb{mb}")
            return
        k = job.tp_collectives_per_pass
        for chunk in range(k):
            b.compute(duration_us / k, name=f"{what} mb{mb}.{chunk}")
            b.collective(OpKind.ALL_REDUCE, "tp", act, name=f"{what} mb{mb}.{chunk}")

    def recv_forward(mb: int) -> None:
        if not first:
            b.recv("pp", -1, act, name=f"act mb{mb}")

    def send_forward(mb: int) -> None:
        if not last:
            b.send("pp", +1, act, name=f"act mb{mb}")

    def recv_backward(mb: int) -> None:
        if not last:
            b.recv("pp", +1, act, name=f"grad mb{mb}")

    def send_backward(mb: int) -> None:
        if not first:
            b.send("pp", -1, act, name=f"grad mb{mb}")

    def send_forward_recv_backward(fwd_mb: int, bwd_mb: int) -> None:
        if last:
            return
        s = b.send("pp", +1, act, is_async=True, name=f"act mb{fwd_mb}")
        r = b.recv("pp", +1, act, is_async=True, name=f"grad mb{bwd_mb}")
        b.wait(s)
        b.wait(r)

    def send_backward_recv_forward(bwd_mb: int, fwd_mb: int) -> None:
        if first:
            return
        s = b.send("pp", -1, act, is_async=True, name=f"grad mb{bwd_mb}")
        r = b.recv("pp", -1, act, is_async=True, name=f"act mb{fwd_mb}")
        b.wait(s)
        b.wait(r)

    num_warmup = min(job.pp - stage - 1, m)
    num_steady = m - num_warmup

    # === Warm-up: forward passes only, filling the pipeline ===
    for mb in range(num_warmup):
        recv_forward(mb)
        run_pass("fwd", mb, fwd_us)
        send_forward(mb)
    if num_steady > 0:
        recv_forward(num_warmup)

    # === Steady state: one forward, one backward (1F1B) ===
    for i in range(num_steady):
        fwd_mb, bwd_mb = num_warmup + i, i
        run_pass("fwd", fwd_mb, fwd_us)
        send_forward_recv_backward(fwd_mb, bwd_mb)
        run_pass("bwd", bwd_mb, bwd_us)
        if i == num_steady - 1:
            send_backward(bwd_mb)
        else:
            send_backward_recv_forward(bwd_mb, fwd_mb + 1)

    # === Cool-down: backward passes only, draining the pipeline ===
    for i in range(num_warmup):
        bwd_mb = num_steady + i
        recv_backward(bwd_mb)
        run_pass("bwd", bwd_mb, bwd_us)
        send_backward(bwd_mb)

    # === Gradient sync across data-parallel replicas, then the optimizer step ===
    if job.grad_sync is GradSync.ALL_REDUCE:
        b.collective(OpKind.ALL_REDUCE, "dp", job.grad_bytes, name="grads")
        if job.optimizer_us:
            b.compute(job.optimizer_us, name="optimizer")
    else:
        b.collective(OpKind.REDUCE_SCATTER, "dp", job.grad_bytes, name="grads")
        if job.optimizer_us:
            b.compute(job.optimizer_us, name="optimizer")
        b.collective(OpKind.ALL_GATHER, "dp", job.grad_bytes, name="params")
    return b


def build_1f1b_graph(job: SyntheticJob) -> ExecutionGraph:
    """The execution graph of `job`: one class per pipeline stage ("pp=<s>").

    >>> g = build_1f1b_graph(SyntheticJob(tp=1, pp=2, dp=1, num_microbatches=2, fwd_us=1.0, bwd_us=2.0,
    ...                                   activation_bytes=0, grad_bytes=0))
    >>> [n.label() for n in g.classes["pp=1"].nodes][:3]
    ['recv pp-1#0 (act mb0)', 'compute (fwd mb0)', 'compute (bwd mb0)']
    """
    layout = WorldLayout(MegatronLayout(world_size=job.world_size, tp=job.tp, pp=job.pp, order=job.order))
    classes = {f"pp={s}": _stage_trace(job, s).build() for s in range(job.pp)}
    metadata = {
        "builder": "synthetic_1f1b",
        "tp": job.tp,
        "pp": job.pp,
        "dp": job.dp,
        "num_microbatches": job.num_microbatches,
        "grad_sync": job.grad_sync.value,
        "order": job.order,
    }
    return ExecutionGraph(layout=layout, class_axes=("pp",), classes=classes, metadata=metadata)
