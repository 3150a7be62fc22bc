"""Megatron's process groups under prism, checked against Megatron's own ``RankGenerator``.

Nothing needs hooking for group construction: ``parallel_state.create_group`` calls
``torch.distributed.new_group``, which torch >= 2.13 hands to the prism default group's
``new_group`` (no rendezvous, and nothing at all for groups this rank is not in); on older torch
the backend creator and the session's redirect of ``backend="gloo"`` do the same. Megatron's gloo
twins (``create_gloo_process_groups=True``, the default) are therefore prism groups too: they
cost one Python object per group this rank belongs to and never rendezvous with the virtual ranks.

`megatron_memberships()` reads the groups Megatron actually built on this rank;
`expected_memberships()` computes, with Megatron's own ``RankGenerator``, the groups Megatron
builds for this rank when all N ranks are real. Tests assert they are equal for many layouts;
`check_memberships()` does it at run time (the wrapper does not call it by default: at N = 65536
the expected groups cost ~10 s to enumerate).
"""

from __future__ import annotations

from typing import Any

__all__ = ["megatron_memberships", "expected_memberships", "check_memberships"]

# parallel_state getter (with kwargs) -> (grid, RankGenerator token)
_DENSE = {
    "tp": ("get_tensor_model_parallel_group", {}, "tp"),
    "pp": ("get_pipeline_model_parallel_group", {}, "pp"),
    "cp": ("get_context_parallel_group", {}, "cp"),
    "dp": ("get_data_parallel_group", {"with_context_parallel": False}, "dp"),
    "dp-cp": ("get_data_parallel_group", {"with_context_parallel": True}, "dp-cp"),
    "mp": ("get_model_parallel_group", {}, "tp-pp"),
    "tp-cp": ("get_tensor_and_context_parallel_group", {}, "tp-cp"),
    "tp-dp": ("get_tensor_and_data_parallel_group", {"with_context_parallel": False}, "tp-dp"),
    "tp-dp-cp": ("get_tensor_and_data_parallel_group", {"with_context_parallel": True}, "tp-dp-cp"),
}
_EXPERT = {
    "ep": ("get_expert_model_parallel_group", {}, "ep"),
    "etp": ("get_expert_tensor_parallel_group", {}, "tp"),
    "etp-ep": ("get_expert_tensor_and_model_parallel_group", {}, "tp-ep"),
    "edp": ("get_expert_data_parallel_group", {}, "dp"),
    "etp-ep-pp": ("get_expert_tensor_model_pipeline_parallel_group", {}, "tp-ep-pp"),
}


def megatron_memberships() -> dict[str, tuple[int, ...]]:
    """Global ranks of each group Megatron's parallel_state holds for this rank (after initialisation)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    out: dict[str, tuple[int, ...]] = {}
    for name, (getter, kwargs, _token) in {**_DENSE, **_EXPERT}.items():
        group = getattr(ps, getter)(**kwargs)
        out[name] = tuple(dist.get_process_group_ranks(group))
    embedding = ps.get_embedding_group(check_initialized=False)
    if embedding is not None:
        out["embedding"] = tuple(dist.get_process_group_ranks(embedding))
    return out


def expected_memberships(world_size: int, rank: int, *, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1,
                         etp: int | None = None, order: str = "tp-cp-ep-dp-pp") -> dict[str, tuple[int, ...]]:
    """The groups containing `rank` that Megatron's ``RankGenerator`` gives for N real ranks."""
    from megatron.core.parallel_state import RankGenerator

    etp = tp if etp is None else etp
    dense = RankGenerator(tp=tp, ep=1, dp=world_size // (tp * pp * cp), pp=pp, cp=cp, order=order)
    expert = RankGenerator(tp=etp, ep=ep, dp=world_size // (etp * ep * pp), pp=pp, cp=1, order=order)
    out: dict[str, tuple[int, ...]] = {}
    for table, generator in ((_DENSE, dense), (_EXPERT, expert)):
        for name, (_getter, _kwargs, token) in table.items():
            matches = [g for g in generator.get_ranks(token) if rank in g]
            assert len(matches) == 1, f"RankGenerator put rank {rank} in {len(matches)} {token} groups"
            out[name] = tuple(matches[0])
    pp_ranks = out["pp"]
    embedding = (pp_ranks[0], pp_ranks[-1]) if len(pp_ranks) > 1 else (pp_ranks[0],)
    if rank in embedding:  # middle pipeline stages hold no embedding group
        out["embedding"] = embedding
    return out


def check_memberships(world_size: int, rank: int, **layout: Any) -> None:
    """Raise AssertionError naming the first group whose members differ from Megatron's own."""
    seen = megatron_memberships()
    expected = expected_memberships(world_size, rank, **layout)
    for name, ranks in expected.items():
        if name in seen and seen[name] != ranks:
            raise AssertionError(f"prism: Megatron's {name} group of rank {rank} is {list(seen[name])[:8]}..., "
                                 f"RankGenerator says {list(ranks)[:8]}...")
