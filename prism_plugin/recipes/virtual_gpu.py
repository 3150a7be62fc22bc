"""The recipe schema's virtual-GPU concept: emulation-only recipes whose expected memory figures are stated.

An emulation with ``device: virtual-gpu`` runs its program under ``prism run --device virtual-gpu`` (fake
cuda tensors on virtual GPUs of the profile's model, or of ``gpu:``; `prism_plugin.device`). This
host has no GPU, so there is no real run of the same job to compare with: such an emulation has
``compare_with: none`` and its `expect` states the exact figures the allocator model must produce on the
device each real rank uses (``peak_allocated_bytes``, ``peak_reserved_bytes``, ``fits``, ``ooms``); a recipe
all of whose emulations are like that has ``real: none``. Example::

    name: virtual-gpu-llama-1b
    framework: torch
    program: llama
    tier: virtual-gpu
    model: {hidden_size: 2048, num_layers: 16, num_attention_heads: 32, num_query_groups: 8, ...}
    steps: {total: 3, warmup: 1}
    real: none
    emulated:
      - name: n8192
        world_size: 8192
        runs: [[5]]
        profile: dgx-h100
        device: virtual-gpu
        compare_with: none
        expect: {peak_allocated_bytes: 34542679552, fits: true}

With ``fits: false`` the job crosses the GPU's memory: ``oom: report`` (``PRISM_VIRTUAL_GPU_OOM=report``)
counts each crossing allocation and runs on, so the recipe reports how much the job needs; with the default
``oom: raise`` the run would stop at torch's ``OutOfMemoryError`` (state that with ``expect.failure``).

Non-goals: step time (a virtual GPU computes in no time: nothing to state), Megatron or DeepSpeed training
loops in this mode (not yet supported by their adapters). Pure: stdlib and the cost layer.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from prism_plugin.config.errors import ConfigError
from prism_plugin.config.kinds import DeviceMode, Framework

__all__ = ["NO_REFERENCE", "OomMode", "TorchProgram", "check_device", "check_virtual_gpu_recipe", "program_module"]

NO_REFERENCE = "none"
"""``compare_with: none``: an emulation compared with no run (its `expect` states its figures)."""


class TorchProgram(StrEnum):
    """The program a ``framework: torch`` recipe runs (``prism_plugin/programs/``)."""

    TOY = "toy"  # toy_train: the TP x DP MLP on CPU
    LLAMA = "llama"  # llama_ddp: a Llama-style decoder, data parallel, bf16 + fp32 AdamW, on CUDA


class OomMode(StrEnum):
    """What a virtual GPU does at an allocation that crosses its memory (``PRISM_VIRTUAL_GPU_OOM``)."""

    RAISE = "raise"  # torch's OutOfMemoryError there, as a GPU would
    REPORT = "report"  # count it in the summary's ooms and serve it beyond the device: the run goes on


def program_module(program: TorchProgram) -> str:
    return {TorchProgram.TOY: "prism_plugin.programs.toy_train", TorchProgram.LLAMA: "prism_plugin.programs.llama_ddp"}[
        program]


def check_device(emu: Any, where: str, error: type[ConfigError]) -> None:
    """The checks of `device`, `gpu`, `oom`, ``compare_with: none`` and memory expectations of `emu` (a
    `prism_plugin.recipes.schema.Emulation`; not imported: schema imports this module)."""
    virtual = emu.device is DeviceMode.VIRTUAL_GPU
    if emu.gpu is not None:
        from prism_plugin.cost.gpu import gpu_spec

        if not virtual:
            raise error(f"{where}.gpu names a virtual GPU model: add device: virtual-gpu or remove gpu")
        try:
            gpu_spec(emu.gpu)
        except ConfigError as exc:
            raise error(f"{where}.gpu: {exc}") from None
    if emu.oom is OomMode.REPORT and not virtual:
        raise error(f"{where}.oom: report is a virtual GPU's setting; add device: virtual-gpu or remove oom")
    memory = emu.expect is not None and emu.expect.states_memory
    if not virtual:
        if emu.compare_with == NO_REFERENCE:
            raise error(f"{where}.compare_with: none is for device: virtual-gpu emulations (no GPU run on this "
                        "host to compare with); compare with real or an earlier emulation")
        if memory:
            raise error(f"{where}.expect: peak_allocated_bytes / peak_reserved_bytes / fits / ooms are a virtual "
                        "GPU's figures; add device: virtual-gpu or remove them")
        return
    if emu.compare_with != NO_REFERENCE:
        raise error(f"{where}: a device: virtual-gpu emulation has no run to compare with on this host (a CPU run's "
                    "memory is not a GPU run's): set compare_with: none and state its figures in expect")
    if emu.data_policy.value != "mirror" or emu.faults or emu.step_time_adjust.value != "none":
        raise error(f"{where}: device: virtual-gpu takes data_policy: mirror, no faults and no step_time_adjust "
                    "(its values are fake and its step time is not modelled)")
    if emu.expect is None or not (memory or emu.expect.failure is not None):
        raise error(f"{where}.expect must state the figures to check: peak_allocated_bytes and/or fits (plus "
                    "optional peak_reserved_bytes, ooms), or failure: \"CUDA out of memory\" with within_s")
    if emu.expect.fits is False and emu.oom is OomMode.RAISE:
        raise error(f"{where}.expect.fits: false with oom: raise stops the run at the first allocation that crosses "
                    "the GPU: set oom: report (count it, run on), or expect failure: \"CUDA out of memory\"")


def check_virtual_gpu_recipe(recipe: Any, error: type[ConfigError]) -> None:
    """Recipe-level checks: the program, ``real: none`` and the emulations on virtual GPUs."""
    virtual = [e for e in recipe.emulated if e.device is DeviceMode.VIRTUAL_GPU]
    if recipe.program is not TorchProgram.TOY and recipe.framework is not Framework.TORCH:
        raise error(f"program: {recipe.program.value} is a framework: torch program; remove program (Megatron and "
                    "DeepSpeed recipes run their shipped programs)")
    if virtual and (recipe.framework is not Framework.TORCH or recipe.program is not TorchProgram.LLAMA):
        raise error("device: virtual-gpu emulations run a CUDA program: framework: torch with program: llama (the "
                    "toy program runs on the CPU; Megatron and DeepSpeed loops are not yet supported in this mode)")
    if recipe.program is TorchProgram.LLAMA:
        m = recipe.model
        for name in ("num_attention_heads", "ffn_hidden_size", "seq_length", "vocab_size"):
            if getattr(m, name) is None:
                raise error(f"program: llama needs model.{name}")
        kv = m.num_query_groups or m.num_attention_heads
        if m.hidden_size % m.num_attention_heads or m.num_attention_heads % kv:  # type: ignore[operator]
            raise error(f"program: llama: model.hidden_size={m.hidden_size} must divide by num_attention_heads="
                        f"{m.num_attention_heads} and that by num_query_groups={kv}")
        if len(virtual) != len(recipe.emulated):
            raise error("program: llama is a CUDA program: every emulation needs device: virtual-gpu (this host runs "
                        "no real CUDA job)")
        if recipe.layout.model_parallel != 1:
            raise error("program: llama is data parallel only; remove layout.tp/pp/cp")
    if recipe.real.launcher.value == "none":
        if any(e.compare_with != NO_REFERENCE for e in recipe.emulated):
            raise error("real: none leaves nothing to compare with: every emulation needs compare_with: none "
                        "(device: virtual-gpu, figures stated in expect), or give a real run")
        if recipe.repeats != 1:
            raise error("repeats: a recipe with real: none checks exact modelled figures; remove repeats")
    elif virtual and len(virtual) == len(recipe.emulated):
        raise error("real: every emulation runs on virtual GPUs and compares with none: set real: none (a real run "
                    "would be started for nothing)")
