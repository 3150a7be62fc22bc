"""The one owner of process-wide state (`prism_plugin.device.active`): every slot declared there, a second holder of
a single slot refused, and nothing held after an emulation ends."""

from __future__ import annotations

import ast
import doctest
import importlib
from pathlib import Path

import pytest

from prism_plugin.device import active

PACKAGE = Path(active.__file__).resolve().parents[1]

DECLARED = {
    "session": ("prism_plugin.runtime.session", False),
    "cuda_graphs": ("prism_plugin.device.graphs", False),
    "cuda_shim": ("prism_plugin.device.shim", False),
    "virtual_time": ("prism_plugin.device.clock", False),
    "storage_tracker": ("prism_plugin.device.memory", False),
    "fusion_regions": ("prism_plugin.device.fusion", False),
    "virtual_gpu": ("prism_plugin.device.device", False),
    "transformer_engine": ("prism_plugin.device.te", True),
    "userbuffers": ("prism_plugin.device.te.userbuffers", True),
    "virtual_cuda_library": ("prism_plugin.device.cuda_runtime", True),
    "megatron_adapter": ("prism_plugin.adapters.megatron.adapter", False),
    "megatron_cpu_shim": ("prism_plugin.adapters.megatron.cpu_shim", False),
    "deepspeed_emulation": ("prism_plugin.adapters.deepspeed.runtime", False),
    "deepspeed_virtual_gpu": ("prism_plugin.adapters.deepspeed.virtual_gpu", True),
}
"""Each piece of process-wide state: the module that owns it, and whether the process keeps it to its exit."""

REBOUND_GLOBALS = {
    ("adapters/deepspeed/runtime.py", "_ATEXIT_REGISTERED"): "atexit registers shutdown once per process",
    ("adapters/deepspeed/grid.py", "_STOCK_BUILD_P2P"): "DeepSpeed's own method, kept to call through",
}
"""The only module globals a function rebinds, and why none of them is an active object."""


def test_the_module_doc_runs() -> None:
    assert doctest.testmod(active).failed == 0


def test_every_piece_of_process_wide_state_is_a_declared_slot() -> None:
    for name, (module, _) in DECLARED.items():
        importlib.import_module(module)
        assert name in active.SLOTS, f"{module} no longer declares the slot {name!r}"
    assert set(active.SLOTS) == set(DECLARED)
    assert {n for n, s in active.SLOTS.items() if s.permanent} == {n for n, (_, keep) in DECLARED.items() if keep}


def test_no_module_keeps_state_in_a_global_of_its_own() -> None:
    rebound = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Global):
                rebound |= {(path.relative_to(PACKAGE).as_posix(), name) for name in node.names}
    assert rebound == set(REBOUND_GLOBALS)


def test_a_single_slot_refuses_a_second_holder_and_a_stacked_one_nests() -> None:
    single, stacked = active.Slot("single"), active.Slot("stacked", stack=True)
    single.enter("a")
    with pytest.raises(active.AlreadyActive, match="single is already active"):
        single.enter("b")
    single.leave("a")
    with stacked.holding("outer"), stacked.holding("inner"):
        assert stacked.current() == "inner" and stacked.all() == ["outer", "inner"]
    assert stacked.current() is None and single.current() is None
    with pytest.raises(ValueError, match="declared twice"):
        active.slot("session")


def test_an_emulation_holds_its_session_and_leaves_nothing_behind() -> None:
    from prism_plugin import activate, deactivate
    from prism_plugin.config.emulation import EmulationConfig, VirtualWorld
    from prism_plugin.runtime.session import SESSION

    before = active.held()
    session = activate(EmulationConfig(world=VirtualWorld(world_size=8, real_ranks=(3,)), timing=False))
    try:
        assert SESSION.current() is session and active.held()["session"] == [session]
        with pytest.raises(RuntimeError, match="already initialised"):
            activate(EmulationConfig(world=VirtualWorld(world_size=8, real_ranks=(3,)), timing=False))
    finally:
        deactivate()
    assert active.held() == before == {}


def test_a_build_lock_left_by_a_killed_build_is_dropped_and_a_fresh_one_kept(tmp_path: Path) -> None:
    """A killed first build of the device library (the permanent ``virtual_cuda_library`` slot's content) left torch's
    build lock, and every later virtual-GPU start waited on it forever."""
    import os
    import time

    from prism_plugin.device import cuda_runtime

    lock = tmp_path / "lock"
    lock.touch()
    cuda_runtime._drop_stale_lock(lock)
    assert lock.exists()  # a build may be running now
    old = time.time() - cuda_runtime._STALE_LOCK_S - 1
    os.utime(lock, (old, old))
    cuda_runtime._drop_stale_lock(lock)
    assert not lock.exists()
    cuda_runtime._drop_stale_lock(lock)  # no lock: nothing to do
