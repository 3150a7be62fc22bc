"""Closed vocabularies shared by every layer: operation kinds, data policies, algorithms.

Pure: imports nothing from torch. Enums instead of bare strings (STYLE.md practice 5).
"""

from __future__ import annotations

from enum import StrEnum


class OpKind(StrEnum):
    """Every communication operation the `prism` backend implements (DESIGN.md section 4)."""

    ALL_REDUCE = "all_reduce"
    BROADCAST = "broadcast"
    REDUCE = "reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"
    GATHER = "gather"
    SCATTER = "scatter"
    BARRIER = "barrier"
    SEND = "send"
    RECV = "recv"

    @property
    def is_p2p(self) -> bool:
        return self in (OpKind.SEND, OpKind.RECV)


class DataPolicy(StrEnum):
    """What values a virtual participant contributes.

    MIRROR: a virtual member contributes what the real members contribute (their mean in a
        reduction, a fixed real member's block in a gather); the default.
    RECORDED: payloads recorded in a real run are replayed bit for bit.
    ZEROS: virtual members contribute zeros (an explicit option, never a fallback).
    """

    MIRROR = "mirror"
    RECORDED = "recorded"
    ZEROS = "zeros"


class Algorithm(StrEnum):
    """Collective algorithms the cost model knows."""

    RING = "ring"
    TREE = "tree"
    HIERARCHICAL = "hierarchical"
    DIRECT = "direct"  # p2p and pairwise all-to-all


class ArrivalAssumption(StrEnum):
    """Where a virtual member's arrival time at an op comes from."""

    SYMMETRIC = "symmetric"  # equals the real rank's own arrival (no execution graph loaded)
    REPLAYED = "replayed"  # from the replay of an execution graph


class DeviceMode(StrEnum):
    """Where a real rank's tensors live and compute.

    REAL: on the host's own devices (the CPU, with the adapters' CPU shim; or the host's real GPUs).
    VIRTUAL_GPU: fake ``cuda`` tensors on virtual GPUs of the profile's GPU model (no storage, no compute):
        real-size jobs on a host without GPUs, exact allocated bytes, a caching-allocator model; step time is
        not modelled (nothing sleeps).
    """

    REAL = "real"
    VIRTUAL_GPU = "virtual-gpu"


class Framework(StrEnum):
    """Whose training program (and parallel layout) a job uses: the one enum of the slicer and the recipes.

    TORCH: plain torch.distributed (the recipes' toy TP x DP MLP, prism_plugin.programs.toy_train); the
        slicer cannot slice it (a `ConfigError`).
    MEGATRON: Megatron-core (its dense grid: tp, cp, dp, pp; virtual pipeline chunks); recipes run its GPT
        through prism_plugin.megatron.
    DEEPSPEED: DeepSpeed (pipe, data, model axes; ZeRO partitions are data-parallel); recipes run
        prism_plugin/programs/deepspeed_mlp.py through prism_plugin.deepspeed.
    """

    TORCH = "torch"
    MEGATRON = "megatron"
    DEEPSPEED = "deepspeed"


class IterationMarker(StrEnum):
    """What delimits training iterations (the clock anchor, trace iterations, replayed arrivals).

    EXPLICIT: only `prism_plugin.mark_iteration()` calls (the adapters make them each step).
    OPTIMIZER_STEP: the end of every ``torch.optim.Optimizer.step()`` (plain scripts; a script with
        two optimizers stepping each iteration marks twice: use EXPLICIT there).
    AUTO: optimizer steps until the first explicit `mark_iteration()`, explicit marks from then on.
    """

    EXPLICIT = "explicit"
    OPTIMIZER_STEP = "optimizer-step"
    AUTO = "auto"
