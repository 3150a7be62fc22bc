"""Virtual time of a compiled extension's launch loop: one call pays the host's per-launch figure once, each further
launch of the call only the driver's (`VirtualTime.native_call`), as TransformerEngine's C++ loops run on a GPU."""

from __future__ import annotations

import pytest

from prism_plugin.config.errors import ConfigError
from prism_plugin.cost.kernels import KernelEfficiency
from prism_plugin.cost.profiles import load_profile
from prism_plugin.device.clock import VirtualTime

LAUNCH, DRIVER = 2.0**-14, 2.0**-18  # binary fractions: every figure below is exact


def clock() -> VirtualTime:
    return VirtualTime(launch_overhead_s=LAUNCH, native_launch_s=DRIVER, current_stream=lambda: (0, 0))


def test_a_call_pays_the_host_figure_once_and_the_driver_for_its_other_launches() -> None:
    c = clock()
    with c.native_call():
        for _ in range(4):
            c.kernel((0, 0), 0.0, "chunk")
        with c.native_call():  # a call made inside the call is part of it
            c.captured_launch()
    assert c.host_s == LAUNCH + 4 * DRIVER and c.last_launch_s == DRIVER
    assert (c.launches, c.native_launches) == (5, 4)
    c.kernel((0, 0), 0.0, "outside")  # outside a call: the host figure again
    with c.native_call():
        c.kernel((0, 0), 0.0, "one")  # a call that launches once costs what a plain launch costs
    assert c.host_s == 3 * LAUNCH + 4 * DRIVER and c.last_launch_s == LAUNCH
    summary = c.summary()
    assert summary["native_launches"] == 4 and summary["native_launch_us"] == round(1e6 * DRIVER, 6)


def test_without_a_driver_figure_every_launch_costs_the_host_figure() -> None:
    c = VirtualTime(launch_overhead_s=LAUNCH, current_stream=lambda: (0, 0))
    with c.native_call():
        c.kernel((0, 0), 0.0, "a")
        c.kernel((0, 0), 0.0, "b")
    assert c.host_s == 2 * LAUNCH and c.summary()["native_launch_us"] == round(1e6 * LAUNCH, 6)
    assert "native_launches" not in VirtualTime(launch_overhead_s=LAUNCH, current_stream=lambda: (0, 0)).summary()


def test_the_profiles_carry_the_driver_figure_and_bad_values_are_refused() -> None:
    assert load_profile("dgx-h100").kernels.native_launch_s == pytest.approx(5e-6)
    with pytest.raises(ConfigError, match=r"kernels.native_launch_us.*>= 0"):
        KernelEfficiency.from_mapping({"native_launch_us": -1})
    with pytest.raises(ValueError, match="native_launch_s"):
        VirtualTime(launch_overhead_s=LAUNCH, native_launch_s=-1.0, current_stream=lambda: (0, 0))
