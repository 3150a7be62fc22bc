"""Recorded payloads: what each rank received, op by op, replayed bit for bit (policy RECORDED).

A recording run (usually every rank real, the prism backend wrapping real gloo/NCCL exchanges)
saves, per rank, the tensors each op wrote into that rank's outputs, keyed by the group's name
(torch's own deterministic name for the k-th `new_group` call) and the op's sequence number in the
group. An emulated run of the same program with the same data replays them into its outputs.

Both are op observers (`prism_plugin.comm.context`): for each op that receives tensors they add a
finishing step, run once the op's data is complete, that overwrites the received tensors with the
recorded payload (`Replayer`) or copies them into the recording (`Recorder`).

File: ``<dir>/rank<R>.pt``, a dict ``{"format": 1, "world_size": N, "payloads": {key: [tensors]}}``;
loaded memory-mapped, so replay holds no payload in RAM beyond the page cache.
"""

from __future__ import annotations

from pathlib import Path

import torch

from prism_plugin.comm.context import OpEvent, OpWork

__all__ = ["Recorder", "Replayer", "RecordingMismatch", "payload_key"]

FORMAT_VERSION = 1


class RecordingMismatch(RuntimeError):
    """The emulated program diverged from the recording (different op, shape or dtype)."""


def payload_key(group_name: str, seq: int) -> str:
    return f"{group_name}#{seq}"


class Recorder:
    """Collects CPU copies of received payloads and writes them at `close()`."""

    def __init__(self, directory: Path, rank: int, world_size: int) -> None:
        self.path = Path(directory) / f"rank{rank}.pt"
        self.world_size = world_size
        self.payloads: dict[str, list[torch.Tensor]] = {}

    def on_op(self, event: OpEvent) -> None:
        if event.received:
            key, outputs = payload_key(event.group.name, event.seq), list(event.received)
            event.add_finish(lambda: self.record(key, outputs))

    def on_issued(self, event: OpEvent, work: OpWork) -> None:
        pass

    def record(self, key: str, outputs: list[torch.Tensor]) -> None:
        self.payloads[key] = [t.detach().to("cpu", copy=True) for t in outputs]

    def close(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"format": FORMAT_VERSION, "world_size": self.world_size, "payloads": self.payloads},
                   self.path)


class Replayer:
    """Writes recorded payloads into an op's outputs, checking they describe the same op."""

    def __init__(self, directory: Path, rank: int, world_size: int) -> None:
        path = Path(directory) / f"rank{rank}.pt"
        if not path.is_file():
            raise FileNotFoundError(
                f"prism: no recording for rank {rank} in {directory} (expected {path.name}); "
                "record a run that includes this rank as a real rank"
            )
        data = torch.load(path, mmap=True, weights_only=True)
        if data.get("format") != FORMAT_VERSION:
            raise RecordingMismatch(f"{path}: recording format {data.get('format')} != {FORMAT_VERSION}")
        if data["world_size"] != world_size:
            raise RecordingMismatch(
                f"{path} was recorded at world_size={data['world_size']}, this run has {world_size}; "
                "replay a recording of the same job"
            )
        self.payloads: dict[str, list[torch.Tensor]] = data["payloads"]

    def on_op(self, event: OpEvent) -> None:
        if event.received:
            key, outputs = payload_key(event.group.name, event.seq), list(event.received)
            event.add_finish(lambda: self.replay(key, outputs))

    def on_issued(self, event: OpEvent, work: OpWork) -> None:
        pass

    def has(self, key: str) -> bool:
        return key in self.payloads

    def replay(self, key: str, outputs: list[torch.Tensor]) -> None:
        recorded = self.payloads.get(key)
        if recorded is None:
            raise RecordingMismatch(f"prism: the recording has no payload for op {key}: the program diverged")
        if len(recorded) != len(outputs):
            raise RecordingMismatch(f"prism: op {key} has {len(outputs)} outputs, recorded {len(recorded)}")
        for out, rec in zip(outputs, recorded, strict=True):
            if out.shape != rec.shape or out.dtype != rec.dtype:
                raise RecordingMismatch(
                    f"prism: op {key} output {tuple(out.shape)}/{out.dtype} but recorded "
                    f"{tuple(rec.shape)}/{rec.dtype}: the program diverged from the recording"
                )
            out.copy_(rec)
