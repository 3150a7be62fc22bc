"""The Megatron-core adapter: unmodified Megatron-core training as k real ranks of an N-rank job.

Modules (only this package imports Megatron, and only when used):

- `adapter`: `MegatronAdapter(session).install()`, the seams an emulated process needs
  (CPU shim, device mapping, iteration marks, rank N-1 logs, valid data and pipeline receives
  from virtual sources);
- `cpu_shim`: the numbered CUDA->CPU patches of CPU mode;
- `compat`: Python 3.11 (``typing.override``) and triton-less imports of Megatron;
- `groups`: Megatron's groups under prism vs Megatron's own ``RankGenerator``;
- `refusals`: features no torch backend can see, refused up front with the flag to change;
- `wrapper`: the drop-in ``--prism-*`` flags (``python -m prism_plugin.megatron script.py ...``);
- `pretrain_gpt.py`: the example job (``megatron.training.pretrain`` + mock GPT data).

Limitations: context parallelism needs TransformerEngine attention (GPU); with the mirror
policy a virtual data-parallel peer's shard in the distributed optimizer's parameter all-gather is
a copy of this rank's shard (valid values, not the job's parameters): use the recorded policy for
numerics.
"""

from __future__ import annotations

from typing import Any

__all__ = ["MegatronAdapter", "CpuShim", "check_args", "Refusal"]

_LAZY = {
    "MegatronAdapter": "prism_plugin.adapters.megatron.adapter",
    "CpuShim": "prism_plugin.adapters.megatron.cpu_shim",
    "check_args": "prism_plugin.adapters.megatron.refusals",
    "Refusal": "prism_plugin.adapters.megatron.refusals",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'prism_plugin.adapters.megatron' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
