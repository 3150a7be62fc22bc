"""`prism plan`: the Megatron layouts of a model on N GPUs, tried on virtual GPUs and ranked by tokens/s/GPU.

    prism plan --model llama3-70b --gpus 1024 [--gpu h100|h200|b200] [--global-batch 1024] [--seq 8192]
    prism plan --gpus 64 --global-batch 128 -- pretrain_gpt.py <the job's Megatron arguments>
    prism plan ... [--max-candidates 30] [--space "tp=2,4,8;pp=4,8;recompute=none,selective"] [--jobs 2]
    prism plan ... [--mark "tp=4,pp=4,vp=5,cp=2"] [--ray local|auto|HOST:PORT] [--output DIR] [--overwrite] [--json]

Stages (`prism_plugin.topology.plan_space`, `prism_plugin.cost.plan_estimate`, `prism_plugin.cli.plan_runs`):

1. **enumerate** every layout Megatron-core accepts (tp, pp, vp, cp, ep/etp, micro-batch, recompute, distributed
   optimizer, FP8), counting the rest under the rule that excludes them; none left is an error naming the rule
   that excluded the most;
2. **order** them by a closed-form guess (fits first, then guessed tokens/s/GPU): an order only, never an exclusion;
3. **memory**: the first ``--max-candidates`` in that order each get a memory-only virtual-GPU run of rank 0; a
   device total over the GPU ends the candidate;
4. **emulate** the survivors with ``prism emulate`` (every class of ranks; virtual time) and **rank** those whose
   every class fits by modelled tokens/s/GPU.

Writes ``OUTPUT/plan.json`` (schema ``prism-plan/1``), ``plan.md`` (the table) and ``memory_vs_throughput.png``, and
one folder per candidate (``candidates/<label>/``: its memory run, its emulation, ``result.json``). A plan into an
OUTPUT that holds an earlier plan resumes it: each candidate whose ``result.json`` matches its command line is read,
not run (``--overwrite`` starts afresh). Ctrl-C or SIGTERM kills every run in flight and keeps what finished.
Exits 0 when at least one candidate was ranked, 1 when none fits or every run failed, 2 on invalid input (before
any run). Every figure is modelled (virtual time, the allocator model), none measured.

The runs' environment sets ``CUDA_DEVICE_MAX_CONNECTIONS=1`` (Megatron asserts it for tp or cp > 1 before
Blackwell; Megatron-LM's launch scripts export it) unless it is set. ``--jobs K`` runs K candidates at a time;
``--ray ADDRESS`` makes every memory and profiling run a Ray task (``local``: an instance here with K CPUs), the
candidates still K at a time. Limitations: no fast-forward yet, so a real-size candidate costs its full emulation.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import sys
import threading
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

from prism_plugin.cli.plan_runs import CandidateResult, PlanJob, run_candidate
from prism_plugin.config.errors import ConfigError, positive_int
from prism_plugin.topology.plan_space import Candidate, Enumeration, Space, no_candidate_message

__all__ = ["GPU_PROFILES", "PUBLISHED", "SCHEMA", "add_plan_parser", "parse_mark", "parse_space", "plan"]

SCHEMA = "prism-plan/1"
GPU_PROFILES = {"h100": "dgx-h100", "h200": "dgx-h200", "b200": "dgx-b200", "a100": "dgx-a100"}
"""``--gpu`` names and the hardware profile each one plans on."""

PUBLISHED = {
    ("llama3-70b", 64): "tp=4,pp=4,vp=5,cp=2",  # NeMo 24.12 performance summary, GBS 128, seq 8192
    ("llama3.1-405b", 576): "tp=8,pp=9,vp=7,cp=2",  # NGC Llama 3.1 405B 24.11.1 (DGXC benchmarking), GBS 252
}
"""NVIDIA's published layout of a preset at a GPU count: marked in the table when ``--mark`` is not given."""

_AXES = {"tp": int, "pp": int, "vp": int, "cp": int, "ep": int, "micro_batch": int, "mbs": int, "recompute": str,
         "distributed_optimizer": bool, "dopt": bool, "fp8": bool}
_ALIASES = {"mbs": "micro_batch", "dopt": "distributed_optimizer"}


def _value(axis: str, text: str) -> Any:
    kind = _AXES[axis]
    if kind is bool:
        if text not in ("on", "off", "true", "false"):
            raise ConfigError(f"--space {axis}={text!r}: give on or off")
        return text in ("on", "true")
    if kind is int:
        if axis == "vp" and text in ("none", "1"):
            return None
        if not re.fullmatch(r"[0-9]+", text):
            raise ConfigError(f"--space {axis}={text!r}: give whole numbers, e.g. {axis}=1,2,4")
        return int(text)
    return text


def parse_space(text: str | None, *, fp8_supported: bool) -> Space:
    """``"tp=2,4;pp=1,2;recompute=none"`` as a `Space` (axes: tp, pp, vp, cp, ep, mbs, recompute, dopt, fp8; each
    unnamed axis its default; vp ``none`` is no interleaving).

    >>> s = parse_space("tp=2,4;mbs=1;dopt=on;vp=none,2", fp8_supported=True)
    >>> s.tp, s.micro_batch, s.distributed_optimizer, s.vp
    ((2, 4), (1,), (True,), (None, 2))
    """
    fields: dict[str, Any] = {"fp8_supported": fp8_supported}
    for part in (text or "").split(";"):
        if not part.strip():
            continue
        axis, sep, values = part.strip().partition("=")
        axis = axis.strip().lower()
        if not sep or axis not in _AXES or not values.strip():
            raise ConfigError(f"--space {part.strip()!r}: give AXIS=V1,V2 with AXIS one of tp, pp, vp, cp, ep, "
                              "mbs, recompute, dopt, fp8; separate axes with ';'")
        fields[_ALIASES.get(axis, axis)] = tuple(_value(axis, v.strip().lower()) for v in values.split(","))
    return Space(**fields)


def parse_mark(text: str) -> dict[str, int | None]:
    """``"tp=4,pp=4,vp=5,cp=2"``: the axes a marked candidate must have (the others are free).

    >>> parse_mark("tp=4,pp=4,vp=5,cp=2")
    {'tp': 4, 'pp': 4, 'vp': 5, 'cp': 2}
    """
    mark: dict[str, int | None] = {}
    for part in text.split(","):
        axis, sep, value = part.strip().partition("=")
        if not sep or axis not in ("tp", "pp", "vp", "cp", "ep", "mbs"):
            raise ConfigError(f"--mark {text!r}: give AXIS=V pairs with AXIS one of tp, pp, vp, cp, ep, mbs, "
                              "separated by ',', e.g. --mark tp=4,pp=4,vp=5,cp=2")
        mark[_ALIASES.get(axis, axis)] = _value(axis, value.strip())
    return mark


def _marked(c: Candidate, mark: dict[str, int | None]) -> bool:
    return all(getattr(c, axis) == value for axis, value in mark.items())


def _job_environment() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    return env


def plan(job: PlanJob, enumeration: Enumeration, ordered: list[tuple[Candidate, Any]], output: Path, *,
         max_candidates: int, jobs: int, timeout_s: float, mark: dict[str, int | None] | None,
         progress: Any = None, ray_address: str | None = None) -> dict[str, Any]:
    """Stages 3 and 4 of the module docstring on the first `max_candidates` of `ordered` (candidate, guess), `jobs`
    at a time, in ``output/candidates``; the plan document (also ``output/plan.json``). With `ray_address` every run
    is a Ray task (Ray started or joined here, and shut down if started here). Ctrl-C / SIGTERM (as SystemExit)
    kill the runs in flight and propagate after the finished ones are cached."""
    tried = ordered[:max_candidates]
    env, stop = _job_environment(), threading.Event()
    results: list[CandidateResult | None] = [None] * len(tried)

    def one(i: int) -> CandidateResult:
        c, g = tried[i]
        folder = output / "candidates" / c.label().replace(" ", "_")
        return run_candidate(job, c, g, i, folder, timeout_s=timeout_s, env=env, stop=stop, ray_address=ray_address)

    with contextlib.ExitStack() as stack:
        if ray_address is not None:
            from prism_plugin.cli.emulate_ray import _import_ray, init_ray

            if init_ray(ray_address, jobs):
                stack.callback(_import_ray().shutdown)
        _run_candidates(one, results, jobs, stop, progress)
    finished = [r for r in results if r is not None]
    for i, (r, (c, _)) in enumerate(zip(finished, tried, strict=True)):  # this plan's order and marks, also for
        r.guess_position = i                                                # a result read from the cache
        r.marks = ["marked"] if mark and _marked(c, mark) else []
    document = plan_document(job, enumeration, ordered, finished, max_candidates, mark)
    (output / "plan.json").write_text(json.dumps(document, indent=1))
    return document


def _run_candidates(one: Any, results: list[CandidateResult | None], jobs: int, stop: threading.Event,
                    progress: Any) -> None:
    pool = ThreadPoolExecutor(max_workers=jobs)
    try:
        futures = {pool.submit(one, i): i for i in range(len(results))}
        pending = set(futures)
        while pending:
            done, pending = wait(pending, return_when=FIRST_COMPLETED)
            for f in done:
                r = results[futures[f]] = f.result()
                if progress is not None:
                    progress(r)
    except BaseException:
        stop.set()  # each run in flight kills its process group; the queued candidates never start
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def plan_document(job: PlanJob, enumeration: Enumeration, ordered: list[tuple[Candidate, Any]],
                  results: list[CandidateResult], max_candidates: int,
                  mark: dict[str, int | None] | None) -> dict[str, Any]:
    """The ``prism-plan/1`` document: the job, the enumeration's counts, every tried candidate, and the ranking
    (the candidates that fit, by modelled tokens/s/GPU, highest first)."""
    ranked = sorted((r for r in results if r.status == "fits" and r.tokens_per_s_per_gpu),
                    key=lambda r: -(r.tokens_per_s_per_gpu or 0.0))
    marked_positions = [i for i, (c, _) in enumerate(ordered) if mark and _marked(c, mark)]
    return {
        "schema": SCHEMA, "model": job.model.name, "gpus": job.gpus, "global_batch": job.global_batch,
        "seq": job.seq, "profile": job.profile, "script": str(job.script), "base_args": list(job.base_args),
        "combinations": enumeration.combinations, "candidates": len(enumeration.candidates),
        "rejected": dict(enumeration.rejected.most_common()), "max_candidates": max_candidates,
        "tried": len(results), "cached": sum(r.cached for r in results),
        "order": "closed-form guess (prism_plugin.cost.plan_estimate): guessed to fit first, then guessed "
                 "tokens/s/GPU; an order only, the runs decide fit and speed",
        "figures": "modelled: virtual time (kernel and cost models) and the allocator model; none measured",
        "mark": mark, "marked_guess_positions": marked_positions[:20],
        "ranking": [r.label for r in ranked],
        "results": [r.to_dict() | {"rank": ranked.index(r) + 1 if r in ranked else None} for r in results],
    }


def add_plan_parser(subparsers: Any) -> None:
    """Add ``prism plan`` to the `prism` command's subparsers."""
    p = subparsers.add_parser("plan", help="the valid Megatron layouts of a model on N GPUs, emulated on virtual "
                                           "GPUs and ranked by tokens/s/GPU")
    p.add_argument("--model", default=None, help="a model preset (`prism models`); or give the job after `--`")
    p.add_argument("--gpus", type=int, required=True, help="N, the GPUs of the job")
    p.add_argument("--gpu", choices=sorted(GPU_PROFILES), default="h100", help="the GPU model (default h100)")
    p.add_argument("--profile", default=None, help="a hardware profile instead of --gpu's (e.g. a calibrated one)")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--global-batch", type=int, default=None, help="sequences per step (default: the job's "
                                                                  "--global-batch-size; a preset: 8 x N)")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (default: the job's or preset's)")
    p.add_argument("--max-candidates", type=int, default=30, help="candidates run, best guess first (default 30)")
    p.add_argument("--space", default=None, help="the axes' values, e.g. \"tp=2,4,8;pp=4,8;recompute=none\"")
    p.add_argument("--mark", default=None, help="mark the candidates with these sizes, e.g. tp=4,pp=4,vp=5,cp=2 "
                                                "(default: NVIDIA's published layout of a preset, where known)")
    p.add_argument("--jobs", type=int, default=1, help="candidates at a time (default 1)")
    p.add_argument("--ray", default=None, metavar="ADDRESS",
                   help="run every memory and profiling run as a Ray task: local (an instance here with --jobs "
                        "CPUs), auto, HOST:PORT or ray://HOST:PORT; the nodes must share this Python and --output")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per run")
    p.add_argument("--output", "--out", type=Path, default=None, help="DIR (default prism_output/plans/<model>-<N>)")
    p.add_argument("--overwrite", action="store_true", help="start afresh in an OUTPUT that holds another plan")
    p.add_argument("--json", action="store_true", help="print the plan document instead of the table")
    p.add_argument("target", nargs=argparse.REMAINDER, help="-- pretrain_gpt.py <Megatron arguments>")
    p.set_defaults(func=_cmd_plan)


def _cmd_plan(args: argparse.Namespace) -> int:
    from rich.console import Console

    from prism_plugin.cli.plan_report import print_table, write_markdown, write_plot
    from prism_plugin.cost import load_profile
    from prism_plugin.cost.gpu import gpu_spec
    from prism_plugin.cost.plan_estimate import order
    from prism_plugin.launch.preflight import OUTPUT_MARKER, claim_output
    from prism_plugin.topology.plan_space import enumerate_layouts

    target = list(args.target)
    if target and target[0] == "--":
        target = target[1:]
    positive_int("--gpus", args.gpus, hint="the job's GPUs, e.g. --gpus 1024")
    positive_int("--max-candidates", args.max_candidates, hint="candidates to run, e.g. --max-candidates 30")
    positive_int("--jobs", args.jobs, hint="candidates at a time, e.g. --jobs 2")
    if (args.model is None) == (not target):
        raise ConfigError("prism plan: give a model preset (--model llama3-70b) or the job after `--` "
                          "(-- pretrain_gpt.py <args>), not both")
    profile = args.profile or GPU_PROFILES[args.gpu]
    hw = load_profile(profile)
    if hw.gpu is None:
        raise ConfigError(f"--profile {profile}: names no GPU model; use a GPU profile such as dgx-h100")
    gpu = gpu_spec(hw.gpu)
    if args.model is not None:
        job = PlanJob.from_preset(args.model, gpus=args.gpus, global_batch=args.global_batch or 8 * args.gpus,
                                  seq=args.seq, profile=profile, gpus_per_node=args.gpus_per_node)
    else:
        job = PlanJob.from_args(target, gpus=args.gpus, global_batch=args.global_batch, seq=args.seq,
                                profile=profile, gpus_per_node=args.gpus_per_node)
    if args.ray:  # a dead address hung ray.init: refused before any run
        from prism_plugin.cli.emulate_ray import _import_ray
        from prism_plugin.cli.sweep import check_ray_address

        check_ray_address(args.ray)
        _import_ray()
    space = parse_space(args.space, fp8_supported="float8" in gpu.peak_flops_per_s)
    mark_text = args.mark or PUBLISHED.get((job.model.name, job.gpus))
    mark = parse_mark(mark_text) if mark_text else None
    found = enumerate_layouts(job.model, job.gpus, job.global_batch, job.seq, space, job.gpus_per_node)
    if not found.candidates:
        raise ConfigError(no_candidate_message(found))
    local = "--transformer-impl" in job.base_args and \
        job.base_args[job.base_args.index("--transformer-impl") + 1] == "local"
    ordered = order(job.model, found.candidates, gpu, job.global_batch, job.seq, fused_attention=not local)
    output: Path = args.output or Path("prism_output") / "plans" / f"{job.model.name}-{job.gpus}"
    marker = output / OUTPUT_MARKER
    resuming = not args.overwrite and marker.is_file() and marker.read_text().strip() == "prism plan"
    if not resuming:
        claim_output("--output", output, "prism plan", overwrite=args.overwrite)
    console = Console(stderr=True)
    tried = min(args.max_candidates, len(ordered))
    console.print(f"prism plan {job.model.name} on {job.gpus} x {gpu.name} ({profile}): {len(found.candidates):,} "
                  f"valid layouts of {found.combinations:,}; running the first {tried} by the guess, "
                  f"{args.jobs} at a time{' on Ray (' + args.ray + ')' if args.ray else ''}"
                  f"{'; resuming ' + str(output) if resuming else ''}; output {output}",
                  markup=False, highlight=False, soft_wrap=True)
    done = [0]

    def progress(r: CandidateResult) -> None:
        done[0] += 1
        figure = f"{r.tokens_per_s_per_gpu:,.0f} tokens/s/GPU" if r.tokens_per_s_per_gpu else (r.error or "")[:120]
        console.print(f"[{done[0]}/{tried}] {r.label}: {r.status}{' (cached)' if r.cached else ''}; {figure}",
                      markup=False, highlight=False, soft_wrap=True)

    previous = signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
    try:
        document = plan(job, found, ordered, output, max_candidates=args.max_candidates, jobs=args.jobs,
                        timeout_s=args.timeout, mark=mark, progress=progress, ray_address=args.ray)
    finally:
        signal.signal(signal.SIGTERM, previous)
    write_markdown(document, output / "plan.md")
    write_plot(document, gpu.total_memory_bytes, output / "memory_vs_throughput.png")
    if args.json:
        print(json.dumps(document, indent=1))
    else:
        print_table(document, gpu.total_memory_bytes)
    return 0 if document["ranking"] else 1
