"""Pipeline transfers from virtual neighbours: valid, non-degenerate activations and gradients.

Megatron's schedules move activations forward and gradients backward through
``P2PCommunicator._communicate`` (``_batched_p2p_ops`` for 1F1B, ``_p2p_ops`` with handles for
the interleaved schedule; with two stages one direction goes over WORLD). The backend gives a
receive from a virtual peer the last tensor this rank sent with that shape, else zeros. Zeros
are valid but degenerate in a pipeline: the last stage of an emulated job whose previous stage is
virtual would train on all-zero hidden states forever (loss pinned at ln(vocab), gradient norm 0),
and Megatron deallocates sent outputs, so a first stage often has nothing left to mirror.

So, under the mirror policy only, a buffer received from a virtual neighbour that came back all
zeros is filled in place (no allocation) with deterministic normal values from a private
generator (the global RNG is untouched): standard deviation 1 for activations (a residual stream
after layer norm has unit scale) and ``1/sqrt(numel)`` for gradients. The values keep the
schedule's control flow and every float finite; they are not the neighbour's real values: the
RECORDED policy replays those.

The same holds for the tied output layer of a last stage whose first stage is virtual: Megatron
zeroes it and all-reduces it with the first stage's embedding over the embedding group, which
under mirror stays zero (uniform logits, loss pinned at ln(vocab)). When it is still all zero
after ``setup_embeddings_and_output_layer``, it is filled with N(0, init_method_std) from the
private generator, like a freshly initialised embedding.

Limitation: with ``variable_seq_lengths`` the shape exchange with a virtual peer mirrors this
rank's own last shape message; before any was sent, Megatron would allocate an empty buffer.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from prism_plugin.config.kinds import DataPolicy
from prism_plugin.device.undo import Patches

__all__ = ["install", "fill_if_degenerate", "DeviceGenerators"]


class DeviceGenerators:
    """One private generator per device type, all seeded alike (CUDA tensors need a CUDA generator)."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._by_device: dict[torch.device, torch.Generator] = {}

    def for_tensor(self, t: torch.Tensor) -> torch.Generator:
        gen = self._by_device.get(t.device)
        if gen is None:
            gen = torch.Generator(device=t.device).manual_seed(self.seed)
            self._by_device[t.device] = gen
        return gen


@torch.no_grad()
def fill_if_degenerate(t: torch.Tensor, generator: torch.Generator | DeviceGenerators, *, gradient: bool) -> bool:
    """Fill `t` in place with N(0, std) when it is all zeros; True when it did."""
    if t.numel() == 0 or bool(t.any()):
        return False
    std = 1.0 / max(1.0, float(t.numel())) ** 0.5 if gradient else 1.0
    gen = generator.for_tensor(t) if isinstance(generator, DeviceGenerators) else generator
    t.normal_(0.0, std, generator=gen)
    return True


def install(session: Any, patches: Patches) -> list[int]:
    """Wrap ``P2PCommunicator._communicate`` (mirror policy only); returns a live [fills] counter."""
    stats = [0]
    if session.config.data_policy is not DataPolicy.MIRROR:
        return stats
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    world = session.config.world
    generator = DeviceGenerators(1_000_003 + session.rank)
    original = P2PCommunicator._communicate

    @functools.wraps(original)
    def _communicate(self: Any, *args: Any, **kwargs: Any) -> Any:
        recv_prev, recv_next, reqs = original(self, *args, **kwargs)
        if recv_prev is not None and self.prev_rank is not None and not world.is_real(self.prev_rank):
            stats[0] += fill_if_degenerate(recv_prev, generator, gradient=False)
        if recv_next is not None and self.next_rank is not None and not world.is_real(self.next_rank):
            stats[0] += fill_if_degenerate(recv_next, generator, gradient=True)
        return recv_prev, recv_next, reqs

    patches.setattr(P2PCommunicator, "_communicate", _communicate)
    _install_tied_output(world, generator, stats, patches)
    return stats


def _install_tied_output(world: Any, generator: DeviceGenerators, stats: list[int], patches: Patches) -> None:
    import torch.distributed as dist
    from megatron.core.models.common.language_module.language_module import LanguageModule

    original = LanguageModule.setup_embeddings_and_output_layer

    @functools.wraps(original)
    def setup_embeddings_and_output_layer(self: Any) -> None:
        original(self)
        pp_group = getattr(self, "pp_group", None)
        if (not self.post_process or self.pre_process or not self.share_embeddings_and_output_weights
                or pp_group is None or pp_group.size() < 2 or world.is_real(dist.get_global_rank(pp_group, 0))):
            return
        weight = self.shared_embedding_or_output_weight()
        with torch.no_grad():
            if weight is not None and weight.numel() and not bool(weight.any()):
                weight.normal_(0.0, float(self.config.init_method_std), generator=generator.for_tensor(weight))
                stats[0] += 1

    patches.setattr(LanguageModule, "setup_embeddings_and_output_layer", setup_embeddings_and_output_layer)
