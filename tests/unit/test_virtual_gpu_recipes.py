"""Virtual-GPU recipes (tier a, no process started): the schema's device / real: none / memory expect fields,
the plan that launches them, the memory rows and checks, and the report's memory table."""

from __future__ import annotations

import copy
import io
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from prism_plugin.recipes.load import load_recipe, recipe_from_mapping
from prism_plugin.recipes.memory import check_memory, memory_rows
from prism_plugin.recipes.plans import emulation_plan, real_plan
from prism_plugin.recipes.report import expect_table, write_summary
from prism_plugin.recipes.runner import RecipeResult
from prism_plugin.recipes.schema import RecipeError, Tier

RECIPES = Path(__file__).resolve().parents[2] / "recipes"

VGPU: dict[str, Any] = {
    "name": "v", "framework": "torch", "program": "llama", "tier": "virtual-gpu",
    "model": {"hidden_size": 256, "num_layers": 2, "num_attention_heads": 8, "num_query_groups": 2,
              "ffn_hidden_size": 512, "vocab_size": 1000, "seq_length": 128},
    "layout": {}, "steps": {"total": 3, "warmup": 1}, "real": "none",
    "emulated": [{"name": "n8192", "world_size": 8192, "runs": [[5]], "profile": "dgx-h100",
                  "device": "virtual-gpu", "compare_with": "none", "expect": {"peak_allocated_bytes": 1000,
                                                                              "fits": True}}],
}


def _v(**emu: Any) -> dict[str, Any]:
    data = copy.deepcopy(VGPU)
    for k, v in emu.items():
        if k.startswith("top_"):
            data[k[4:]] = v
        elif v is None:
            data["emulated"][0].pop(k, None)
        else:
            data["emulated"][0][k] = v
    return data


def test_an_emulation_only_virtual_gpu_recipe_validates() -> None:
    r = recipe_from_mapping(_v())
    assert not r.real.exists and r.real.world_size == 0 and r.tier is Tier.VIRTUAL_GPU
    emu = r.emulated[0]
    assert emu.device.value == "virtual-gpu" and emu.oom.value == "raise" and emu.expect is not None
    assert emu.expect.states_memory and emu.expect.peak_allocated_bytes == 1000


@pytest.mark.parametrize(("data", "message"), [
    (_v(compare_with="real"), "set compare_with: none"),
    (_v(gpu="h999"), "gpu='h999' is not a known GPU model"),
    (_v(expect={"fits": False}), "set oom: report"),
    (_v(expect=None), "expect must state the figures"),
    (_v(expect={"peak_allocated_bytes": -1}), "peak_allocated_bytes"),
    (_v(expect={"fits": True, "ooms": 3}), "a job that fits has no OOM"),
    (_v(faults=["straggler:ranks=1,factor=2"]), "no faults"),
    (_v(device="real", expect=None), "compare_with: none is for device: virtual-gpu"),
    (_v(top_program="toy"), "program: llama"),
    (_v(top_real={"world_size": 2}), "set real: none"),
    (_v(top_framework="megatron"), "framework: torch program"),
    (_v(device="cpu"), "device='cpu' is not one of"),
    (_v(oom="ignore"), "oom='ignore' is not one of"),
])
def test_virtual_gpu_fields_are_checked(data: dict[str, Any], message: str) -> None:
    with pytest.raises(RecipeError, match=message.replace("(", r"\(").replace(")", r"\)")):
        recipe_from_mapping(data)


def test_real_none_needs_emulations_that_compare_with_none() -> None:
    data = {"name": "t", "framework": "torch", "model": {"hidden_size": 64}, "layout": {"tp": 2},
            "steps": {"total": 6, "warmup": 2}, "real": "none",
            "emulated": [{"name": "n4", "world_size": 4, "runs": [[0]]}]}
    with pytest.raises(RecipeError, match="compare_with: real, but real: none"):
        recipe_from_mapping(data)


def test_the_shipped_virtual_gpu_recipes_load_and_state_their_figures() -> None:
    small, big = (load_recipe(RECIPES / f"virtual-gpu-{n}.yaml") for n in ("llama-1b", "llama3-8b"))
    assert small.emulated[0].expect.fits is True and small.emulated[0].expect.ooms == 0  # type: ignore[union-attr]
    assert big.emulated[0].expect.fits is False and big.emulated[0].oom.value == "report"  # type: ignore[union-attr]
    assert (big.model.hidden_size, big.model.num_layers, big.model.num_attention_heads, big.model.num_query_groups,
            big.model.ffn_hidden_size, big.model.vocab_size, big.model.seq_length) == (4096, 32, 32, 8, 14336,
                                                                                     128256, 4096)


def test_the_plan_launches_prism_run_on_virtual_gpus_without_the_probe(tmp_path: Path) -> None:
    r = recipe_from_mapping(_v(oom="report", gpu="h200-sxm", expect={"fits": False}))
    plan = emulation_plan(r, r.emulated[0], 0, tmp_path, None)
    (proc,) = plan.processes
    argv = list(proc.argv)
    assert argv[argv.index("--device") + 1] == "virtual-gpu" and argv[argv.index("--gpu") + 1] == "h200-sxm"
    assert argv[argv.index("--world-size") + 1] == "8192" and argv[argv.index("--real-ranks") + 1] == "5"
    assert argv[argv.index("--profile") + 1] == "dgx-h100"
    target = argv[argv.index("--") + 1:]
    assert target[:2] == ["-m", "prism_plugin.programs.llama_ddp"] and "prism_plugin.recipes.probe" not in argv
    assert target[target.index("--kv-heads") + 1] == "2" and target[target.index("--steps") + 1] == "3"
    assert proc.env["PRISM_VIRTUAL_GPU_OOM"] == "report" and not plan.probe
    assert plan.summary_dir == tmp_path / "prism" and plan.ranks == (5,)
    with pytest.raises(RecipeError, match="real: none"):
        real_plan(r, tmp_path)


def _summary(peak: int, reserved: int, fits: bool, ooms: int) -> dict[str, Any]:
    devices = [{"device": i, "allocated_bytes": 0, "peak_allocated_bytes": peak if i == 0 else 0,
                "peak_requested_bytes": 0, "reserved_bytes": 0, "peak_reserved_bytes": reserved if i == 0 else 0,
                "fragmentation_at_peak": 0.02 if i == 0 else 0.0,
                "device_total_bytes": (reserved if i == 0 else 0) + 512 * 2**20, "fits": fits if i == 0 else True,
                "ooms": [{}] * ooms if i == 0 else []} for i in range(8)]
    return {"virtual_gpu": {"gpu": "NVIDIA H100 80GB HBM3", "gpu_memory_bytes": 81559 * 2**20,
                            "context_bytes": 512 * 2**20, "devices": devices}}


def test_memory_rows_and_checks_use_the_ranks_own_device(tmp_path: Path) -> None:
    r = recipe_from_mapping(_v(expect={"peak_allocated_bytes": 1000, "peak_reserved_bytes": 2 << 20, "fits": True}))
    rows = memory_rows(r, {"n8192": {5: [_summary(1000, 2 << 20, True, 0)]}})
    assert [(m.rank, m.device, m.own_device) for m in rows] == [(5, 0, True)]  # unused devices are left out
    checks = check_memory(r, r.emulated[0], rows)
    assert [(c.check, c.passed) for c in checks] == [("peak_allocated_bytes", True), ("peak_reserved_bytes", True),
                                                     ("fits", True)]
    wrong = check_memory(r, r.emulated[0], memory_rows(r, {"n8192": {5: [_summary(1512, 2 << 20, True, 0)]}}))
    assert [c.passed for c in wrong] == [False, True, True] and wrong[0].measured == "1,512 B"
    assert all(not c.passed for c in check_memory(r, r.emulated[0], []))  # no summary: every figure fails

    result = RecipeResult(recipe=r, output=tmp_path, outcomes={"n8192": []}, figures={}, comparisons=[], summary={},
                          expectations=checks, memory=rows)
    out = io.StringIO()
    Console(file=out, width=200).print(expect_table(result))
    text = out.getvalue()
    assert "virtual-GPU memory" in text and "1,000 B" in text and "cuda:0" in text and "2,097,152 B" in text
    md = write_summary(result, []).read_text()
    assert "## Virtual-GPU memory" in md and "| n8192 | 5 | cuda:0 | 0.00 GiB (1,000 B) |" in md
    assert result.to_dict()["virtual_gpu_memory"][0]["peak_reserved_bytes"] == 2 << 20
