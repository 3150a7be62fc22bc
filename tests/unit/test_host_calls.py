"""`prism_plugin.adapters.megatron.host_calls`: Megatron's host-hardware calls on virtual GPUs are counted no-ops,
undone with the adapter's patches."""

from __future__ import annotations

from prism_plugin.adapters.megatron import compat, host_calls
from prism_plugin.device.undo import Patches


def test_the_gpu_affinity_call_is_skipped_and_counted() -> None:
    compat.import_megatron_core()
    import megatron.core.pipeline_parallel.utils as utils

    original = utils.set_ideal_affinity_for_current_gpu
    patches = Patches()
    calls = host_calls.install(patches)
    try:
        utils.set_ideal_affinity_for_current_gpu()  # would import cuda-python and NVML on a GPU host
        utils.set_ideal_affinity_for_current_gpu()
        assert calls.summary() == {"set_ideal_affinity_for_current_gpu": 2}
    finally:
        patches.close()
    assert utils.set_ideal_affinity_for_current_gpu is original
