"""The per-rank summary as a typed model, with a published JSON schema (issue 19, part 2).

Every real rank writes one summary (``PRISM_SUMMARY <json>`` on stdout, ``<output>/rank<R>.summary.json``;
`prism_plugin.runtime.lifecycle.write_summary`). `RankSummary` is its model: the session's figures (ops, bytes,
modelled communication, arrivals), the run's outcome (``exit_code``, ``error``), and one optional section per
part that took part (``virtual_gpu`` with its `DeviceSummary` per device, ``megatron``, ``deepspeed``, ``memory``,
``graph``, ``trace``, ``timeline``, ``kineto``, ``faults``, ``graph_check``). `NotEmulated` is the summary of a program
that never called ``init_process_group``. The top level is closed (an unknown key is a schema error); the
sections' inner reports are open objects, each documented where it is built.

``python -m prism_plugin.runtime.summary`` writes the schema to ``docs/summary.schema.json`` (``--check``: exit 1
when it is stale); `write_summary` checks each summary against the model and says so on stderr, naming the field,
when one does not match (a summary is never lost for it).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

__all__ = ["SCHEMA_PATH", "DeviceSummary", "NotEmulated", "RankSummary", "VirtualGpuSummary", "check", "schema"]

SCHEMA_PATH = Path(__file__).resolve().parents[2] / "docs" / "summary.schema.json"

_Section = dict[str, Any]


class _Closed(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DeviceSummary(_Closed):
    """One virtual GPU of the rank's process (allocator model; modelled)."""

    device: int
    allocated_bytes: int
    cublas_workspaces: int
    cublas_workspace_bytes: int
    peak_allocated_bytes: int
    peak_requested_bytes: int
    reserved_bytes: int
    peak_reserved_bytes: int
    fragmentation_at_peak: float
    device_total_bytes: int = Field(description="peak reserved + NCCL buffers + userbuffers + CUDA context")
    device_total: _Section
    fits: bool
    ooms: list[Any]


class VirtualGpuSummary(_Closed):
    """The virtual GPUs of a ``--device virtual-gpu`` rank: memory per device, virtual time and kernels."""

    device_mode: Literal["virtual-gpu"]
    gpu: str
    gpu_memory_bytes: int
    context_bytes: int
    device_total_note: str
    step_time: str
    virtual_time: _Section | None = None
    kernels: _Section | None = None
    cpu_adam: _Section | None = Field(default=None, description="DeepSpeed ZeRO-Offload's CPU Adam steps: bytes "
                                      "streamed through host memory and their modelled host time")
    host_memory: _Section | None = Field(default=None, description="host tensors the program made from device "
                                         "ones (fake: no host memory used): live and peak bytes, as a real run "
                                         "would hold them")
    cuda_graphs: _Section | None = Field(default=None, description="CUDA graphs the program captured: captures, "
                                         "replays (one launch each) and the replays' device seconds")
    host_counts: _Section | None = Field(default=None, description="what the program asked of the host, counted "
                                         "(device ops, in backward or not; nn.Module calls by origin): evidence "
                                         "for a host-time model, not timed")
    devices: list[DeviceSummary] = Field(description="the devices this process touched: its own, and any other "
                                                      "it allocated on")
    untouched_devices: list[int] = Field(default_factory=list, description="the other devices' indices")
    values: _Section


class RankSummary(_Closed):
    """The summary of one real rank that took part in an emulation."""

    rank: int = Field(description="the virtual rank this process played")
    world_size: int
    real_ranks: list[int]
    profile: str
    data_policy: Literal["mirror", "recorded", "zeros"]
    arrivals: Literal["symmetric", "replayed"]
    arrivals_note: str
    groups_created: int
    iterations_marked: int
    op_counts: dict[str, int]
    op_bytes: dict[str, int]
    modelled_comm_s: float = Field(description="modelled communication time of this rank's ops, seconds")
    clock: Literal["wall", "emulated"]
    communicator_memory: _Section
    emulated_waits: _Section
    graph: _Section | None = None
    graph_check: _Section | None = None
    trace: _Section | None = None
    timeline: _Section | None = None
    kineto: _Section | None = None
    faults: _Section | None = None
    device_mode: Literal["virtual-gpu"] | None = None
    virtual_gpu: VirtualGpuSummary | None = None
    megatron: _Section | None = None
    deepspeed: _Section | None = None
    memory: _Section | None = None
    policy_defaults: list[dict[str, str]] | None = None
    exit_code: int | None = None
    error: str | None = None
    run_id: str | None = None


class NotEmulated(_Closed):
    """The summary of a program that never called ``init_process_group`` (nothing emulated)."""

    rank: int
    world_size: int
    real_ranks: list[int]
    emulated: Literal[False]
    exit_code: int | None
    note: str
    device_mode: Literal["virtual-gpu"] | None = None
    virtual_gpu: VirtualGpuSummary | None = None
    run_id: str | None = None


_ADAPTER: TypeAdapter[RankSummary | NotEmulated] = TypeAdapter(RankSummary | NotEmulated)


def schema() -> dict[str, Any]:
    """The JSON schema of a summary (either form), as published in ``docs/summary.schema.json``."""
    doc = _ADAPTER.json_schema()
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "title": "prism per-rank summary", **doc}


def check(summary: Any) -> str | None:
    """None when `summary` (parsed JSON) matches the model; else the first mismatches, naming each field."""
    try:
        _ADAPTER.validate_python(json.loads(json.dumps(summary, default=str)))
    except ValidationError as exc:
        return "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()[:5])
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m prism_plugin.runtime.summary", description=__doc__)
    ap.add_argument("--output", "--out", type=Path, default=SCHEMA_PATH)
    ap.add_argument("--check", action="store_true", help="exit 1 if --output differs from the model's schema")
    args = ap.parse_args(argv)
    from prism_plugin.config.reference import write_generated

    return write_generated(args.output, json.dumps(schema(), indent=1, sort_keys=True) + "\n", check=args.check,
                           command="python -m prism_plugin.runtime.summary")


if __name__ == "__main__":
    sys.exit(main())
