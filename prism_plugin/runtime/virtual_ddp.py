"""torch DDP (``torch.nn.parallel.DistributedDataParallel``) on virtual GPUs: what its C++ side needs that fake
tensors do not hold.

DDP's constructor checks that every rank holds parameters of the same shapes (``dist._verify_params_across_processes``:
each rank's shapes and strides as an int64 metadata tensor, broadcast from group rank 0 and compared on the host).
The C++ check fills and reads that tensor's values, which a fake tensor has not. `install` replaces it, for fake
parameters only, with the same check on a host tensor: the same metadata (sizes, then strides, of each
parameter), the same broadcast over the same group (so it is counted and timed as the original, and with several
real ranks their metadata really travels through the inner group), the host waiting for it as the original's
blocking copy to the host does, and the same comparison.

DDP's logger samples runtime statistics (forward, backward and communication times) with the reducer's timer of
the parameters' device type; a CPU-only torch registers no CUDA timer, and the logger's INTERNAL ASSERT on the
missing timer would stop the first forward. On virtual GPUs those samples are skipped (``set_runtime_stats_and_log``
raises nothing for the missing timer): ``ddp._get_ddp_logging_data()`` lacks the ``avg_*_time`` entries, which the
emulated timeline and the summary's step times give instead.

Refused, naming the flag (`refuse_unsupported`): ``find_unused_parameters=True`` and ``static_graph=True``
(``_set_static_graph()``) on fake parameters: the C++ reducer keeps a pinned host map of the parameters used in
each iteration and reads it by raw memory, which a fake tensor has not (and a CPU-only torch has no pinned
memory). The rest of DDP runs unchanged on fake tensors: the
broadcast of the module states (``dist._broadcast_coalesced``), the bucketed reducer and its gradient hooks
(`prism_plugin.comm.work.TimedWork.get_future` keeps the reducer's waits deterministic on virtual time).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor

from prism_plugin.comm.group import host_tensors
from prism_plugin.device.undo import Patches

__all__ = ["install", "refuse_unsupported", "verify_param_shapes"]


def refuse_unsupported(module: torch.nn.Module, *, find_unused_parameters: bool, static_graph: bool) -> None:
    """Raise for the DDP options fake parameters cannot run (module docstring); nothing for real ones."""
    if not (find_unused_parameters or static_graph):
        return
    if not any(isinstance(p, FakeTensor) for p in module.parameters()):
        return
    flag = "find_unused_parameters=True" if find_unused_parameters else "static_graph=True"
    raise NotImplementedError(
        f"prism virtual GPU: DistributedDataParallel({flag}) keeps a pinned host map of the parameters each "
        "iteration used, which its C++ reducer reads by raw memory: fake tensors hold none (and a CPU-only torch "
        f"has no pinned memory). Drop {flag} (a model whose parameters all get gradients needs neither), or run "
        "this part with --device real")


def verify_param_shapes(process_group: Any, tensors: Sequence[torch.Tensor], logger: Any = None,
                        *, original: Any = None) -> None:
    """torch's ``_verify_param_shape_across_processes`` for fake parameters (module docstring); real ones go to
    `original`."""
    if not any(isinstance(t, FakeTensor) for t in tensors):
        if original is None:
            raise RuntimeError("prism: verify_param_shapes needs torch's check for real tensors (original=)")
        return original(process_group, list(tensors), logger)
    with host_tensors():
        metadata = torch.tensor([v for t in tensors for v in (*t.shape, *t.stride())], dtype=torch.int64)
        control = metadata.clone()
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        process_group.broadcast([control], opts).wait()
        mine, theirs = metadata.tolist(), control.tolist()
    if torch.cuda.is_available():  # the original's blocking copy of the result to the host
        torch.cuda.current_stream().synchronize()
    i = 0
    for p, t in enumerate(tensors):
        n = 2 * t.dim()
        if mine[i:i + n] != theirs[i:i + n]:
            raise RuntimeError(f"DDP expects same model across all ranks, but parameter {p} has sizes and strides "
                               f"{mine[i:i + n]} here and {theirs[i:i + n]} on group rank 0: build the same model "
                               "on every rank")
        i += n
    return None


def install(patches: Patches) -> None:
    """Route DDP's parameter-shape check through `verify_param_shapes` until `patches` close."""
    import torch.distributed.utils as dist_utils
    import torch.nn.parallel.distributed as ddp_module

    original = dist_utils._verify_param_shape_across_processes

    def check(process_group: Any, tensors: list[torch.Tensor], logger: Any = None) -> None:
        return verify_param_shapes(process_group, tensors, logger, original=original)

    patches.setattr(dist_utils, "_verify_param_shape_across_processes", check)
    patches.setattr(ddp_module, "_verify_param_shape_across_processes", check)
    log = dist.Logger.set_runtime_stats_and_log

    def set_runtime_stats_and_log(logger: Any) -> None:
        try:
            log(logger)
        except RuntimeError as exc:  # no CUDA timer in a CPU-only torch (module docstring)
            if "reducer_->timer_" not in str(exc):
                raise

    patches.setattr(dist.Logger, "set_runtime_stats_and_log", set_runtime_stats_and_log)
    ddp_class = ddp_module.DistributedDataParallel
    init, set_static = ddp_class.__init__, ddp_class._set_static_graph
    signature = inspect.signature(init)

    def ddp_init(self: Any, *args: Any, **kwargs: Any) -> None:
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        refuse_unsupported(a["module"], find_unused_parameters=bool(a["find_unused_parameters"]),
                           static_graph=bool(a["static_graph"]))
        init(self, *args, **kwargs)

    def set_static_graph(self: Any) -> None:
        refuse_unsupported(self.module, find_unused_parameters=False, static_graph=True)
        set_static(self)

    patches.setattr(ddp_class, "__init__", functools.wraps(init)(ddp_init))
    patches.setattr(ddp_class, "_set_static_graph", functools.wraps(set_static)(set_static_graph))
