"""One more iteration's memory without running it: the allocator requests of the last iteration, replayed.

A run that needs only its first K-1 iterations whole (`prism emulate`'s profiling runs: the execution graph keeps the
steady iteration K-1, closed by the mark that starts K) may end where iteration K starts. Its memory figures must
still be those of the run that trains iteration K: the caching allocator's block layout keeps changing after the
first steady iteration (blocks split differently, a request lands in a larger block), so iteration K can reach a
higher peak than K-1 with the very same requests.

`IterationRequests` records every request the virtual GPU's allocator models receive from the mark that starts
iteration K-1 to the mark that starts K (a malloc by device, size and stream; a free by its *distance*, how many
mallocs ago the freed block was allocated), the fast-forward's replayed periods included (they reach the models
too), through the models' history hook (`CachingAllocatorModel.history`). At the mark of K, `replay` runs those
requests once more on the models: iteration K's, as a steady iteration repeats the one before it (the same
assumption that lets the graph's one steady iteration stand for every later one). Blocks, splits, segments, every
statistic and peak are then what the models give for iteration K.

A block allocated in iteration K-2 and freed in K-1 (a lifetime across the mark: the last pipeline input a module
keeps until the next step's first, the loss accumulators Megatron's log replaces) stands in the replay for the block
K-1 allocated and left alive in the same place among those it carries into K: births are numbered from the mark of
K-2 on, and the blocks K-2 carried into K-1 (and K-1 freed) must be the same requests, in the same order, as those
K-1 carries into K.

Refused (`replay` says why and the run goes on to train iteration K for real): carried sets that differ, a free of
a block allocated before the mark of K-2, an out-of-memory or a released segment in the recording (``empty_cache``,
e.g. Megatron's ``--empty-unused-memory-level``: not a request), or a model whose history is already recorded
(memory snapshots). Pure: no framework import.
"""

from __future__ import annotations

from typing import Any

__all__ = ["IterationRequests", "RequestLog", "is_request_hook"]


class RequestLog:
    """Allocator blocks numbered by birth (their malloc's number), and requests run on the models by size and
    stream (a malloc) or by distance (a free: the block allocated that many mallocs ago). The fast-forward's
    recording (`prism_plugin.device.fast_forward`) and `IterationRequests` both keep one."""

    def __init__(self) -> None:
        self.mallocs = 0
        """Mallocs numbered so far (the next one's number)."""
        self.born: dict[int, int] = {}
        """id(block) -> its malloc's number, for the numbered blocks alive."""
        self.blocks: dict[int, Any] = {}
        """Malloc number -> its block, while alive."""

    def number(self, block: Any) -> int:
        """Number `block`, just allocated; returns its number."""
        made = self.mallocs
        self.born[id(block)] = made
        self.blocks[made] = block
        self.mallocs += 1
        return made

    def forget(self, block: Any) -> int | None:
        """`block` is freed: its number, or None when it was never numbered."""
        made = self.born.pop(id(block), None)
        if made is not None:
            del self.blocks[made]
        return made

    def malloc(self, model: Any, size: int, stream: int) -> Any:
        """Run a malloc on `model` itself (past any tap on the instance) and number its block."""
        block = type(model).malloc(model, size, stream)
        self.number(block)
        return block

    def free(self, model: Any, distance: int) -> None:
        """Run on `model` the free of the block allocated `distance` mallocs ago."""
        block = self.blocks[self.mallocs - distance]
        self.forget(block)
        type(model).free(model, block)


class IterationRequests(RequestLog):
    """The allocator requests of `allocators` (`prism_plugin.cost.allocator.CachingAllocatorModel`) of one iteration:
    `start` at the mark before it (births are numbered from there), `begin` at its own mark (requests recorded from
    there), `replay` at the next mark."""

    def __init__(self, allocators: list[Any]) -> None:
        super().__init__()
        self.allocators = allocators
        self.events: list[tuple[Any, ...]] | None = None
        self.window = 0
        """The number of the first malloc of the recorded iteration (births are numbered from `start`)."""
        self._request: dict[int, tuple[int, int]] = {}
        """Malloc number -> (size, stream) of the request, for the blocks alive."""
        self.refused: str | None = None
        """Why the recording cannot be replayed (None: it can)."""
        self.replayed: dict[str, int] = {}

    def start(self) -> bool:
        """Number births from now on; False (and `refused` says why) when a model's history is already taken."""
        if any(model.history is not None for model in self.allocators):
            self.refused = "the allocator's memory history is recorded"
            return False
        for model in self.allocators:
            model.history = _Hook(self, model.device)
        return True

    def begin(self) -> None:
        """The recorded iteration starts (its mark)."""
        self.window, self.events = self.mallocs, []

    def stop(self) -> None:
        for model in self.allocators:
            if isinstance(model.history, _Hook):
                model.history = None

    def on_alloc(self, device: int, block: Any, size: int) -> None:
        self._request[self.number(block)] = (size, block.stream)
        if self.events is not None:
            self.events.append(("m", device, size, block.stream))

    def on_free(self, device: int, block: Any) -> None:
        made = self.forget(block)
        if made is not None:
            request = self._request.pop(made)
        if self.events is None:
            return
        if made is None:
            self.refused = self.refused or "the iteration frees a block allocated before the iteration before it"
        elif made < self.window:  # carried in from the iteration before: its counterpart is one this one carries
            self.events.append(("x", device, made, request))
        else:
            self.events.append(("f", device, self.mallocs - made))

    def on_oom(self) -> None:
        self.refused = self.refused or "the iteration ran out of memory"

    def on_release(self) -> None:
        """A cached segment released (``empty_cache``, or a malloc's retry under memory pressure): not a request the
        recording can repeat."""
        if self.events is not None:
            self.refused = self.refused or "the allocator released cached memory in the iteration (empty_cache)"

    def replay(self) -> str | None:
        """Stop recording and run the recorded requests once more on the models: None, or why not (nothing run).

        A block the recorded iteration freed but the one before it allocated stands, in the replay, for the block
        the recorded iteration allocated and left alive in the same place among those it carries over (by birth):
        the two carried sets must be the same requests (size and stream) in the same order."""
        self.stop()
        if self.events is None:
            return "no iteration was recorded"
        if self.refused is not None:
            return self.refused
        carried = sorted(m for m in self.blocks if m >= self.window)
        crossed = sorted((e[2], e[3]) for e in self.events if e[0] == "x")
        if [self._request[m] for m in carried] != [request for _, request in crossed]:
            return (f"the iteration carries {len(carried)} block(s) into the next, not the {len(crossed)} it freed "
                    "of the iteration before's in the same order")
        counterpart = {made: self.blocks[m] for (made, _), m in zip(crossed, carried, strict=True)}
        by_device = {model.device: model for model in self.allocators}
        for event in self.events:
            model = by_device[event[1]]
            if event[0] == "m":
                self.malloc(model, event[2], event[3])
            elif event[0] == "f":
                self.free(model, event[2])
            else:
                type(model).free(model, counterpart.pop(event[2]))
        kinds = [event[0] for event in self.events]
        self.replayed = {"mallocs": kinds.count("m"), "frees": len(kinds) - kinds.count("m"), "carried": len(carried)}
        return None


class _Hook:
    """A model's history hook feeding `IterationRequests` (the other actions are not requests)."""

    def __init__(self, requests: IterationRequests, device: int) -> None:
        self.requests = requests
        self.device = device

    def on_alloc(self, block: Any, size: int) -> None:
        self.requests.on_alloc(self.device, block, size)

    def on_free(self, block: Any) -> None:
        self.requests.on_free(self.device, block)

    def on_oom(self, *args: Any) -> None:
        self.requests.on_oom()

    def on_segment_alloc(self, *args: Any) -> None:
        pass

    def on_segment_free(self, *args: Any) -> None:
        self.requests.on_release()

    def on_segment_map(self, *args: Any) -> None:
        pass

    def on_segment_unmap(self, *args: Any) -> None:
        self.requests.on_release()


def is_request_hook(history: Any) -> bool:
    """Whether a model's `history` is an `IterationRequests` recording (the fast-forward runs beside it: its
    replayed periods reach the models, so the recording holds them)."""
    return isinstance(history, _Hook)
