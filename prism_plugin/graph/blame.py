"""Blame chains of a replay: which rank waited on whom, for how long, per step, back to the root cause.

For one rank and one step (one chained copy of a `steady_state` replay, or the single iteration of a plain
`replay`), the chain starts at the op where the rank was held longest waiting for a peer (time blocked
until the op's last member arrived: the *bubble* of `replay`). The member that arrived last is blamed;
the chain then follows that member: its own longest wait on a peer that ended before it arrived, and so
on, until a rank whose lateness was not a wait (it was computing: the root, e.g. a straggler), a wait
shorter than `min_wait_us`, or a wait on a rank already in the chain (the rank is then the root: it was
only waiting on ranks that wait on it, e.g. a pipeline's warm-up).

Ranks in a folded replay stand for their block (`ranks_like_it`); a link names the block's representative.
Limitation: one chain per (rank, step), through the single longest wait at each hop.

Pure: no torch.
"""

from __future__ import annotations

from typing import Any

from prism_plugin.graph.errors import GraphError
from prism_plugin.graph.result import ReplayResult

__all__ = ["annotate_chrome_trace", "blame_chain", "blame_report", "plot_blame"]


def _waits(result: ReplayResult, a: int, lo: int, hi: int, before_us: float) -> tuple[int, float]:
    """(node index, wait us) of actor `a`'s longest wait on a peer among nodes [lo, hi) ending by `before_us`."""
    e = result._e
    prog = e.programs[a]
    best, best_wait = -1, 0.0
    for i in range(lo, hi):
        if prog.kinds[i] != 1 or e.end[a][i] > before_us or e.last[a][i] < 0:  # 1: a communication op
            continue
        if prog.is_async[i]:
            w = prog.link[i]
            if w < 0:
                continue
            blocked_from = e.issue[a][w]
        else:
            blocked_from = e.issue[a][i]
        wait = min(e.ready[a][i], e.end[a][i]) - blocked_from
        if wait > best_wait:
            best, best_wait = i, wait
    return best, best_wait


def blame_chain(result: ReplayResult, rank: int, *, step: int = 0, steps: int = 1,
                min_wait_us: float = 1.0, max_hops: int = 16) -> list[dict[str, Any]]:
    """The chain of waits of `rank` in `step` (0-based copy of `steps` chained ones), from `rank` to the root.

    Each hop: ``{"rank", "waited_us", "op", "on_rank", "ranks_like_it"}``; the last entry is the root
    (``"on_rank": None``, ``"waited_us": 0``: it was not waiting).

    >>> from prism_plugin.cost import CostModel, load_profile
    >>> from prism_plugin.config.faults import parse_faults
    >>> from prism_plugin.graph.replay import replay
    >>> from prism_plugin.graph.synthetic import SyntheticJob, build_1f1b_graph
    >>> g = build_1f1b_graph(SyntheticJob(tp=1, pp=1, dp=4, num_microbatches=1, fwd_us=10.0, bwd_us=20.0,
    ...                                   activation_bytes=0, grad_bytes=4096))
    >>> r = replay(g, CostModel(load_profile("dgx-h100")), faults=parse_faults(["straggler:ranks=2,factor=2"]))
    >>> [(h["rank"], round(h["waited_us"], 1), h["on_rank"]) for h in blame_chain(r, 0)]
    [(0, 30.0, 2), (2, 0.0, None)]
    """
    space, e = result.space, result._e
    actor = space.actor_of(rank)
    a = actor.index
    n = len(e.programs[a].kinds) // steps
    if not 0 <= step < steps:
        raise GraphError(f"step={step} must be in 0..{steps - 1}")
    chain: list[dict[str, Any]] = []
    seen = {a}
    before = float("inf")
    for _ in range(max_hops):
        lo, hi = step * n, (step + 1) * n
        i, wait = _waits(result, a, lo, hi, before)
        rep = space.actors[a]
        if i < 0 or wait < min_wait_us:
            chain.append({"rank": rep.rep_rank, "waited_us": 0.0, "op": None, "on_rank": None,
                          "ranks_like_it": rep.num_ranks})
            break
        b = e.last[a][i]
        if b in seen:  # the wait leads back into the chain (e.g. a pipeline's warm-up): this rank is the root
            chain.append({"rank": rep.rep_rank, "waited_us": 0.0, "op": None, "on_rank": None,
                          "ranks_like_it": rep.num_ranks})
            break
        chain.append({"rank": rep.rep_rank, "waited_us": wait, "op": e.programs[a].nodes[i].label(),
                      "on_rank": space.actors[b].rep_rank, "ranks_like_it": rep.num_ranks})
        seen.add(b)
        before = e.ready[a][i]  # b arrived then: what held b must have ended by that time
        a = b
        n = len(e.programs[a].kinds) // steps
    return chain


def blame_report(result: ReplayResult, ranks: list[int], *, steps: int = 1,
                 min_wait_us: float = 1.0) -> dict[str, list[dict[str, Any]]]:
    """JSON-ready ``{rank: [{"step", "waited_us", "chain"}, ...]}`` for every step of each of `ranks`."""
    out: dict[str, list[dict[str, Any]]] = {}
    for r in ranks:
        rows = []
        for s in range(steps):
            chain = blame_chain(result, r, step=s, steps=steps, min_wait_us=min_wait_us)
            rows.append({"step": s, "waited_us": round(chain[0]["waited_us"], 3),
                         "root_rank": chain[-1]["rank"],
                         "chain": [{**h, "waited_us": round(h["waited_us"], 3)} for h in chain]})
        out[str(r)] = rows
    return out


def plot_blame(report: dict[str, list[dict[str, Any]]], path: Any, *, title: str = "waits per step") -> None:
    """A PNG of `blame_report`'s figures: per step, each rank's longest wait (ms), labelled with the root rank.

    matplotlib is imported here only (an optional dependency of this one plot).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    ranks = list(report)
    width = 0.8 / max(1, len(ranks))
    for k, r in enumerate(ranks):
        rows = report[r]
        xs = [row["step"] + k * width for row in rows]
        ys = [row["waited_us"] / 1e3 for row in rows]
        ax.bar(xs, ys, width=width, label=f"rank {r}")
        for x, y, row in zip(xs, ys, rows, strict=True):
            if y > 0:
                ax.annotate(f"root {row['root_rank']}", (x, y), ha="center", va="bottom", fontsize=7)
    ax.set_xlabel("step (chained replay iteration)")
    ax.set_ylabel("longest wait on a peer (ms)")
    ax.set_title(title)
    if ranks:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def annotate_chrome_trace(trace: dict[str, Any], result: ReplayResult) -> dict[str, Any]:
    """Add blame to a `prism_plugin.graph.export.chrome_trace` object, in place; returns it.

    Every "wait for peers" span gets ``args.waited_on_rank`` (the member that arrived last), and a flow
    arrow (Perfetto: "blame") runs from that rank's arrival at the op to the end of the wait, so the
    chain from a waiting rank back to the faulty one can be followed by clicking through arrows. The
    arrow starts on the blamed rank's row only when that rank is in the trace.
    """
    e = result._e
    events = trace["traceEvents"]
    listed = {ev["pid"] for ev in events if ev.get("ph") == "M"}
    flows: list[dict[str, Any]] = []
    for ev in events:
        if ev.get("ph") != "X" or ev.get("cat") != "bubble":
            continue
        rank, i = ev["pid"], ev["args"]["node"]
        a = result.space.actor_of(rank).index
        b = e.last[a][i]
        if b < 0:
            continue
        on = result.space.actors[b].rep_rank
        ev["args"]["waited_on_rank"] = on
        if on in listed and on != rank:
            fid = len(flows) // 2 + 1
            flows.append({"ph": "s", "id": fid, "pid": on, "tid": ev["tid"], "ts": ev["ts"] + ev["dur"],
                          "name": "blame", "cat": "blame"})
            flows.append({"ph": "f", "bp": "e", "id": fid, "pid": rank, "tid": ev["tid"],
                          "ts": ev["ts"] + ev["dur"], "name": "blame", "cat": "blame"})
    events.extend(flows)
    return trace
