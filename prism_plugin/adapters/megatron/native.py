"""What `patches/megatron-core-0.19.2` calls: the ``--prism-*`` flags read by Megatron itself.

The patch adds ``--prism-world-size``, ``--prism-real-ranks``, ``--prism-profile``,
``--prism-graph`` and ``--prism-output`` to ``megatron/training/arguments.py`` and, in
``parse_args`` right after Megatron reads RANK / WORLD_SIZE from the environment, calls
`activate_from_args(args)`: the launcher's RANK (process i) and WORLD_SIZE (k processes) become
``args.rank = real_ranks[i]`` and ``args.world_size = N``, and the emulation is activated there
(refusals first, before any process group exists), so everything Megatron derives from the world
(validation, micro-batch calculator, TensorBoard/W&B writers, initialisation) sees rank r of N.
``megatron/training/initialize.py`` gets the ``--fake-process-group``-style branch: with the
flags set, ``_initialize_distributed`` calls `activate_from_args` (a no-op when parse_args did)
instead of ``init_process_group``.

Same behaviour as the wrapper (`wrapper`, whose `start_run` it shares), minus its argv handling; the
CPU-mode fusion switch-offs are set on this very namespace (the adapter's ``parse_args`` hook only sees
later calls). The summary is written at exit (without ``exit_code``: the program's exit is not seen here).
"""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["activate_from_args", "flags_from_args"]


def flags_from_args(args: argparse.Namespace) -> Any:
    """The wrapper's `PrismFlags` for Megatron's parsed ``--prism-*`` arguments."""
    from prism_plugin.adapters.megatron.wrapper import PrismFlags

    values = {"world-size": str(args.prism_world_size), "real-ranks": str(args.prism_real_ranks or "")}
    for name in ("profile", "graph", "output"):
        value = getattr(args, f"prism_{name}", None)
        if value is not None:
            values[name] = str(value)
    return PrismFlags(values=values)


def activate_from_args(args: argparse.Namespace) -> Any:
    """Activate the emulation for Megatron's parsed args (idempotent); returns the session.

    The run (`lifecycle.EmulatedRun`, through the wrapper's `start_run`) finishes at interpreter exit:
    deactivate, then the summary (stdout line and ``<output>/rank<R>.summary.json``).
    """
    import torch

    import prism_plugin as P
    from prism_plugin.adapters.megatron.refusals import check_args
    from prism_plugin.adapters.megatron.wrapper import _check_layout, start_run

    session = P.current_session()
    if session is not None:
        return session
    config = flags_from_args(args).to_config()
    cpu_mode = not torch.cuda.is_available()
    check_args(args, cpu_mode=cpu_mode)
    _check_layout(config, args)
    process_index = int(getattr(args, "prism_process_index", args.rank))
    k = int(getattr(args, "prism_num_processes", args.world_size))
    if k != config.world.num_real:
        raise P.ConfigError(f"--prism-real-ranks lists {config.world.num_real} ranks but {k} processes were "
                            f"launched; use torchrun --nproc-per-node {config.world.num_real}")
    args.prism_process_index, args.prism_num_processes = process_index, k
    args.rank = config.world.virtual_rank_of(process_index)
    args.world_size = config.world.world_size
    run = start_run(config, process_index, k, cpu_mode, cuda_peak=False)
    run.finish_at_exit()
    from prism_plugin.adapters.megatron.adapter import current_adapter

    adapter = current_adapter()
    if adapter is not None:  # this parse_args call is already under way: the adapter's hook misses it
        adapter.apply_switch_offs(args)
    return run.session
