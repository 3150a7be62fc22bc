"""What virtual GPUs accept and refuse of a TransformerEngine job, before any process starts."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from prism_plugin.adapters.megatron.refusals import switch_offs, virtual_gpu_refusals
from prism_plugin.device import te

TE_JOB = {"transformer_impl": "transformer_engine", "position_embedding_type": "rope"}


def test_te_is_installed_by_the_set_up() -> None:
    assert te.available() and (te.te_path() / f"transformer_engine-{te.TE_VERSION}.dist-info").is_dir()


def test_a_te_job_with_its_fused_kernels_and_userbuffers_runs_on_virtual_gpus() -> None:
    job = {**TE_JOB, "tp_comm_overlap": True, "moe_grouped_gemm": True, "moe_permute_fusion": True,
           "moe_router_fusion": True,
           "attention_backend": SimpleNamespace(name="flash")}
    assert te.flash_available()  # flash-attn's Python layer, installed by the set-up beside TE's
    assert virtual_gpu_refusals(job) == []  # TE's permutation: Triton kernels as launchers (triton_kernels)
    assert [s.flag for s in switch_offs(job, virtual_gpu=True)] == []  # TE's fused RoPE is a fake kernel
    assert [s.flag for s in switch_offs({**job, "transformer_impl": "local"}, virtual_gpu=True)] == \
        ["--no-rope-fusion"]


@pytest.mark.parametrize("options,fragment", [
    ({"transformer_impl": "local", "moe_grouped_gemm": True}, "--moe-grouped-gemm"),
    ({"transformer_impl": "local", "moe_permute_fusion": True}, "--moe-permute-fusion"),
    ({"transformer_impl": "local", "moe_router_fusion": True}, "--moe-router-fusion"),
])
def test_what_te_does_not_provide_is_refused_naming_the_flag(options: dict, fragment: str) -> None:
    (message,) = virtual_gpu_refusals(options)
    assert message.startswith(fragment)


def test_without_te_installed_the_refusal_names_the_set_up(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PRISM_TE_PATH", str(tmp_path))
    (message,) = virtual_gpu_refusals(TE_JOB)
    assert "scripts/setup_env.sh" in message and str(tmp_path) in message and "--transformer-impl local" in message


def test_the_flash_backend_without_flash_attn_names_the_set_up(monkeypatch: pytest.MonkeyPatch,
                                                              tmp_path: Path) -> None:
    (tmp_path / f"transformer_engine-{te.TE_VERSION}.dist-info").mkdir()  # TE there, flash-attn not
    monkeypatch.setenv("PRISM_TE_PATH", str(tmp_path))
    (message,) = virtual_gpu_refusals({**TE_JOB, "attention_backend": SimpleNamespace(name="flash")})
    assert message.startswith("--attention-backend flash: flash-attn 2.8.3") and "scripts/setup_env.sh" in message
    assert "--attention-backend fused" in message


def test_prism_te_off_emulates_a_host_without_te(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PRISM_TE", "off")
    assert not te.available() and te.install() is False
    (message,) = virtual_gpu_refusals(TE_JOB)
    assert "PRISM_TE=off" in message
