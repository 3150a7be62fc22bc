"""Fake execution on the CPU device: the program's tensors are fake CPU tensors (no storage, no compute).

The validation of fake execution itself (issue 12, item 5a): the virtual GPU runs programs on fake ``cuda``
tensors, whose memory can be checked against no real run on a host without GPUs. The same program on fake
``cpu`` tensors can: its storages, counted by the same `prism_plugin.device.memory.StorageTracker` a real CPU
run uses, must be the real run's to the byte, step by step. What this mode adds to ``FakeTensorMode``:

- every tensor made while it is active is fake (``allow_non_fake_inputs``: tensors made before are real inputs);
- object collectives (``all_gather_object``, ``broadcast_object_list``, ...) run outside the fake modes on real
  pickled bytes, as on a virtual GPU (their temporaries are not counted: they are the real run's only at set-up);
- a data-dependent read (``aten._local_scalar_dense``: ``.item()``, ``float(t)``, ``if t:``) is answered by the
  virtual GPU's value policy (`prism_plugin.device.values.ValuePolicy`: finite losses, no inf/NaN
  found), counted per call site; the answers feed no allocation of the tiny recipe programs; a small tensor made
  from data (``torch.tensor``) keeps its real values for such reads (Megatron's broadcast run flags), and a small
  ``random_`` fill is drawn for real (DataLoader's seed);

Entered before a tracker, it sits below it: the tracker sees each op as the program issues it (as in a real run)
and FakeTensorMode makes its outputs. As a launcher prefix::

    python -m prism_plugin.runtime.fake_cpu -m prism_plugin.recipes.probe -m prism_plugin.programs.toy_train ...
    prism run --world-size 2 --real-ranks 0 -- -m prism_plugin.runtime.fake_cpu -m prism_plugin.recipes.probe ...

DeepSpeed programs start through ``python -m prism_plugin.adapters.deepspeed.fake_cpu`` instead, which first installs
the DeepSpeed adapter's stated answers (ZeRO's overflow and invalid-norm flags read 0, as on a virtual GPU). At exit
it prints one ``PRISM_FAKE_CPU {json}`` line (the value policy's answers).

Limitations: values are not computed, so a program whose allocations depend on values (data-dependent shapes,
a skipped step on overflow) diverges from its real run there (FakeTensorMode raises on data-dependent shapes);
collectives must not reach a real backend with fake tensors (emulated ranks whose peers are all virtual are fine:
no bytes move); what the CPU wheel's kernels allocate internally, outside the dispatcher, is unseen in both runs.
"""

from __future__ import annotations

import atexit
import json
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from prism_plugin.device.undo import Patches
from prism_plugin.device.values import ValuePolicy

__all__ = ["FakeCpu", "main"]

aten = torch.ops.aten
_FROM_DATA = {torch.tensor, torch.as_tensor}
_RANDOM_FILLS = {aten.random_.default, getattr(aten.random_, "from"), aten.random_.to}


class _Reads(TorchDispatchMode):
    """Above FakeTensorMode: answer data-dependent reads from the value policy, note what produced each tensor."""

    def __init__(self, values: ValuePolicy) -> None:
        super().__init__()
        self.values = values

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func is aten._local_scalar_dense.default:
            return self.values.read(args[0])
        out = func(*args, **(kwargs or {}))
        self.values.observe(func, args, kwargs or {}, out)
        if func in _RANDOM_FILLS and isinstance(out, FakeTensor) and out.numel() <= 64:
            # a small random fill (DataLoader's base seed: empty(()).random_(generator)) is drawn for real: the
            # generator advances as in a real run and the program's read of it gets a value
            with _disable_current_modes(), torch._C.DisableTorchFunction():
                real = func(torch.empty(out.shape, dtype=out.dtype), *args[1:], **(kwargs or {}))
            self.values.tag_data(out, real)
        return out


class _Constants(TorchFunctionMode):
    """``torch.tensor`` / ``as_tensor`` of plain data: the fake result keeps the data's real values (small tensors,
    `ValuePolicy.tag_data`), so the program's later reads of what it wrote there (Megatron's run flags) see them,
    as the virtual GPU's constants do."""

    def __init__(self, values: ValuePolicy, fake: FakeTensorMode) -> None:
        super().__init__()
        self.values = values
        self.fake = fake

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func in _FROM_DATA and args and isinstance(args[0], list | tuple):
            nested = _nested_fakes(args[0])
            if nested is not None:
                # torch.tensor([fake scalars]) reads each element's value in C++, below every mode (Megatron's local
                # l2 norm): a fake of that shape, values unknown; made outside the tracker, as a real run's tensor
                # from data is (its storage never reaches the dispatcher: `memory` leaves lift_fresh out)
                shape, dtype = nested
                with _disable_current_modes(), torch._C.DisableTorchFunction(), self.fake:
                    return torch.empty(shape, dtype=(kwargs or {}).get("dtype") or dtype)
        out = func(*args, **(kwargs or {}))
        if func in _FROM_DATA and isinstance(out, FakeTensor) and out.numel() <= 64:
            try:
                with _disable_current_modes(), torch._C.DisableTorchFunction():
                    real = func(*args, **{k: v for k, v in (kwargs or {}).items() if k != "device"})
            except Exception:  # the data holds fake tensors: no values to keep
                return out
            self.values.tag_data(out, real)
        return out


def _nested_fakes(data: list | tuple) -> tuple[list[int], torch.dtype] | None:
    """(shape, dtype) of nested lists of 0-dim fake tensors, None when `data` is anything else."""
    if not data:
        return None
    if all(isinstance(x, FakeTensor) and x.dim() == 0 for x in data):
        return [len(data)], data[0].dtype
    inner = [_nested_fakes(x) if isinstance(x, list | tuple) else None for x in data]
    if inner[0] is None or any(i != inner[0] for i in inner):
        return None
    shape, dtype = inner[0]
    return [len(data), *shape], dtype


class FakeCpu:
    """Fake CPU execution for this thread, from `start` (or ``with``) to `stop`."""

    def __init__(self, values: ValuePolicy | None = None) -> None:
        self.values = values or ValuePolicy()
        self.fake = FakeTensorMode(allow_non_fake_inputs=True)
        self._reads = _Reads(self.values)
        self._constants = _Constants(self.values, self.fake)
        self._started = False

    def _swap_tensors(self, t1: torch.Tensor, t2: torch.Tensor) -> None:
        """``torch.utils.swap_tensors`` as ``Module.to`` / ``_apply`` uses it on fake parameters: it always swaps a
        FakeTensor parameter with a new Parameter of ``fn(param)`` (a real CPU tensor's ``.to(cpu)`` is no swap at
        all). When that is the same storage with the same metadata (``.to`` of a tensor already there), the swap
        would change nothing and is skipped: weak references on the parameter (the fake mode's converter memo,
        DeepSpeed's parameter-name map) would make it refuse. Otherwise both are forgotten by the converter memo
        and the value policy, then swapped."""
        if (t1.untyped_storage()._cdata == t2.untyped_storage()._cdata and t1.shape == t2.shape
                and t1.stride() == t2.stride() and t1.dtype == t2.dtype and t1.device == t2.device
                and t1.storage_offset() == t2.storage_offset() and t1.requires_grad == t2.requires_grad):
            return
        memo = self.fake.fake_tensor_converter.meta_converter.tensor_memo
        for key in [k for k, v in list(memo.items()) if v is t1 or v is t2]:
            del memo[key]
        for t in (t1, t2):
            self.values._answers_of.pop(id(t), None)
            self.values._data.pop(id(t), None)
        self._original_swap(t1, t2)

    def start(self) -> FakeCpu:
        assert not self._started, "fake CPU execution already started"
        from prism_plugin.device.device import _object_collectives_on_cpu
        from prism_plugin.device.undo import Patches

        self._original_swap = torch.utils.swap_tensors
        torch.utils.swap_tensors = self._swap_tensors
        self._patches = Patches()
        _object_collectives_on_cpu(self._patches)  # pickled objects are real bytes: outside the fake modes, as there
        self.fake.__enter__()
        self._reads.__enter__()
        self._constants.__enter__()
        self._started = True
        return self

    def stop(self) -> None:
        if self._started:
            self._started = False
            self._constants.__exit__(None, None, None)
            self._reads.__exit__(None, None, None)
            self.fake.__exit__(None, None, None)
            torch.utils.swap_tensors = self._original_swap
            self._patches.close()

    def __enter__(self) -> FakeCpu:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def summary(self) -> dict[str, Any]:
        return {"device_mode": "fake-cpu", "values": self.values.summary()}


def main(argv: list[str] | None = None, install: Callable[[Patches, FakeCpu], None] | None = None) -> None:
    """Run the target (``script.py args`` or ``-m module args``) on fake CPU tensors. `install`, called before the
    first tensor is fake, puts in a framework's stated answers (`prism_plugin.adapters.deepspeed.fake_cpu`)."""
    from prism_plugin.runtime.lifecycle import run_target

    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        raise SystemExit("usage: python -m prism_plugin.runtime.fake_cpu script.py [args] | -m module [args] "
                         "(DeepSpeed programs: python -m prism_plugin.adapters.deepspeed.fake_cpu ...)")
    fake = FakeCpu().start()
    if install is not None:
        install(Patches(), fake)
    atexit.register(lambda: print("PRISM_FAKE_CPU " + json.dumps(fake.summary(), default=str), flush=True))
    run_target(args)


if __name__ == "__main__":
    main()
