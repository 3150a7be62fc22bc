"""ZeRO-3 under emulation: ``deepspeed.zero.Init`` on torch 2.13, and the consistency checks with a virtual rank 0.

**zero.Init and dynamo** (`prepare_zero_init`): inside its context ``deepspeed.zero.Init`` replaces
``torch.Tensor.__new__`` by its own ``new_tensor(cls, *args, **kwargs)``. When ``torch._dynamo`` is
first imported inside that context (any ``torch.compiler.disable`` a model constructor runs, the first
operator under a FakeTensorMode, ...), dynamo's ``polyfills/tensor.py`` registers its substitute for
``Tensor.__new__`` against the patched function and the import fails with ``TypeError: Signature
mismatch between ...new_tensor... and ... tensor_pynew`` (DeepSpeed 0.19.8 with torch 2.13, with or
without prism). Importing dynamo before the context is entered registers it against the real
``Tensor.__new__``; the emulation does so when it starts, before any Init context can be entered (the
patched ``zero.Init`` initialises communication in its constructor, before ``__enter__``). Costs the
dynamo import (~1 s) once per process; nothing is compiled.

ZeRO-3 checks that every rank traces the same module/parameter order: rank 0 broadcasts its list
(``assert_ints_same_as_other_ranks``), the other ranks prepare the receive buffer with sentinels
(``-1``) and compare. A broadcast from a virtual root keeps the receiver's buffer, i.e. the sentinels,
and the check fails although every rank in the emulated job would agree.

Under the mirror and zeros policies, while rank 0 is virtual, this hook hands the backend what rank 0
would send if it traced what this rank traced (the mirror rule: a virtual member in the same
structural position contributes this rank's values): the list length, then the list. With the
recorded policy nothing is done, the recorded payloads are rank 0's real lists. The check itself is
unchanged: a real rank 0 that disagrees still fails it.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from prism_plugin.config.kinds import DataPolicy

if TYPE_CHECKING:
    from prism_plugin.adapters.deepspeed.runtime import DeepSpeedEmulation

__all__ = ["install", "prepare_zero_init"]


def prepare_zero_init() -> None:
    """Import ``torch._dynamo`` now, outside any ``deepspeed.zero.Init`` context (see the module docstring)."""
    import torch._dynamo  # noqa: F401


def install(emulation: DeepSpeedEmulation) -> None:
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.zero import utils as zero_utils

    if emulation.section.emulation.data_policy is DataPolicy.RECORDED:
        return
    if emulation.section.emulation.world.is_real(0):
        return

    def queue(values: torch.Tensor) -> None:
        device = torch.device(get_accelerator().current_device_name())
        dist.group.WORLD.vg.pending_root_payloads.append(values.to(device))

    original_len = zero_utils.assert_lst_len_same_as_other_ranks
    original_lst = zero_utils.get_lst_from_rank0

    @functools.wraps(original_len)
    def assert_lst_len_same_as_other_ranks(lst: list[int]) -> Any:
        queue(torch.tensor(len(lst), dtype=int))
        return original_len(lst)

    @functools.wraps(original_lst)
    def get_lst_from_rank0(lst: list[int]) -> Any:
        queue(torch.tensor(lst, dtype=int))
        return original_lst(lst)

    emulation.patches.setattr(zero_utils, "assert_lst_len_same_as_other_ranks", assert_lst_len_same_as_other_ranks)
    emulation.patches.setattr(zero_utils, "get_lst_from_rank0", get_lst_from_rank0)
