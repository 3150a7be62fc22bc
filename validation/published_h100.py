"""Re-run the rows of recipes/RESULTS.md "Validation against published H100 throughput" (issue 13, 6a).

Each row is a published, measured BF16 H100 training throughput of a Megatron-core job (NVIDIA's DGX Cloud
benchmarking recipes, which run NeMo on Megatron-core) and the `prism emulate` command that reproduces its
configuration on virtual GPUs. Nothing here is fitted: the kernel model is the dgx-h100 profile's roofline with
its own efficiency estimates, so every row is a validation row.

    .venv/bin/python validation/published_h100.py                 # every row
    .venv/bin/python validation/published_h100.py nemotron4-15b-16 # one row (see ROWS)
    .venv/bin/python validation/published_h100.py --table          # the table from validation/published/*.json
    .venv/bin/python validation/published_h100.py [...] --write-results  # also the results document's data

``--write-results`` writes ``validation/results/published_h100.json`` from the reports (`results_data`: every row
with a report or an out-of-memory record, the per-class figures) and regenerates ``recipes/RESULTS.md`` from it;
with ``--table`` it keeps the data file's date, host conditions, sources and notes (the reports are that run's).

Each run writes ``validation/published/<row>.emulate.json`` (the report of `prism emulate`); the table compares
its tokens/s/GPU and model TFLOP/s/GPU with the published figures. One row at a time: a full-depth model
fake-executes at about 0.2-0.3 s per layer and micro-batch on a 2-core host (wall times in RESULTS.md).

Every row runs with what the published NeMo runs get from TransformerEngine and apex, as far as the emulator has it
(all recorded in RESULTS.md):

- ``PRISM_ATTENTION=flash`` (the drop-in's ``--prism-attention flash``, inherited by every profiling run of
  `prism emulate`): the local spec's core attention computes as fused flash attention
  (`prism_plugin.adapters.megatron.attention`), as TE's does; so ``--recompute-granularity selective`` is dropped
  (the published runs recompute nothing; it was needed only while the local spec kept the s x s scores).
- ``--sequence-parallel`` (NeMo's default for TP > 1): on virtual GPUs the local spec's norm takes it (the
  adapter's ``install_sp_norm``), so the rows run the repository's unmodified ``pretrain_gpt.py``.
- ``CUDA_DEVICE_MAX_CONNECTIONS=1``, as every Megatron launch with TP > 1 sets it.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from prism_plugin.cli.emulate import emulate

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the repository's validation package (this file runs as a script)
from validation.results import DATA_DIR, write_source  # noqa: E402

OUT = ROOT / "validation" / "published"
PROGRAM = "prism_plugin/programs/pretrain_gpt.py"
H100_BF16_TFLOPS = 989.0
"""The published MFU's denominator (the table's since the first run; the predicted MFU is the report's own)."""

_DGXC = "https://github.com/NVIDIA/dgxc-benchmarking/blob/0b71cfda5163540778e2a3d2db59858bf62f96f7"
_DGXC_340B = "https://github.com/NVIDIA/dgxc-benchmarking/blob/main/nemotron/README_340b.md"
_LAUNCHER = ("https://github.com/NVIDIA/NeMo-Framework-Launcher/blob/main/launcher_scripts/conf/training/nemotron/"
             "nemotron_{}.yaml")

# Nemotron-4 architecture as NeMo's launcher config gives it (layernorm1p is approximated by LayerNorm: the
# local spec refuses zero-centred gamma; same cost).
_NEMOTRON4_15B = [
    "--num-layers", "32", "--hidden-size", "6144", "--ffn-hidden-size", "24576", "--num-attention-heads", "48",
    "--group-query-attention", "--num-query-groups", "8", "--seq-length", "4096", "--max-position-embeddings",
    "4096", "--vocab-size", "256000", "--normalization", "LayerNorm", "--squared-relu",
    "--position-embedding-type", "rope", "--rotary-percent", "0.5", "--untie-embeddings-and-output-weights",
    "--disable-bias-linear", "--attention-dropout", "0.0", "--hidden-dropout", "0.0"]
_NEMOTRON4_340B = [
    "--num-layers", "96", "--hidden-size", "18432", "--ffn-hidden-size", "73728", "--num-attention-heads", "96",
    "--group-query-attention", "--num-query-groups", "8", "--seq-length", "4096", "--max-position-embeddings",
    "4096", "--vocab-size", "256000", "--normalization", "LayerNorm", "--squared-relu",
    "--position-embedding-type", "rope", "--rotary-percent", "0.5", "--untie-embeddings-and-output-weights",
    "--disable-bias-linear", "--attention-dropout", "0.0", "--hidden-dropout", "0.0"]

_COMMON = ["--train-iters", "3", "--lr", "1e-4", "--mock-data", "--tokenizer-type", "NullTokenizer", "--bf16",
           "--use-distributed-optimizer", "--overlap-grad-reduce",
           "--overlap-param-gather", "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000000",
           "--disable-gloo-process-groups", "--transformer-impl", "local", "--sequence-parallel"]


def _layout(tp: int, pp: int, mbs: int, gbs: int, vp: int | None = None) -> list[str]:
    args = ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
            "--micro-batch-size", str(mbs), "--global-batch-size", str(gbs)]
    if vp:
        args += ["--num-virtual-stages-per-pipeline-rank", str(vp)]
    return args


def _n15(n: int, gbs: int, step_s: float | None, mfu: float | None) -> dict:
    published = None
    if step_s is not None:
        # the recipe's own formulas: tokens/s = seq x GBS / step; its model FLOPs 434.5e12 per sequence
        published = {"step_s": step_s, "tokens_per_s_per_gpu": round(4096 * gbs / step_s / n, 1),
                     "tflops_per_s_per_gpu": round(434.5e12 * gbs / step_s / n / 1e12, 1), "mfu": mfu}
    return {"name": f"nemotron4-15b-{n}" + ("" if step_s is not None else f"-gbs{gbs}"),
            "model": "Nemotron-4 15B", "gpus": n, "gbs": gbs, "mbs": 4, "seq": 4096,
            "layout": "TP4 PP1 CP1 VP- EP1", "precision": "BF16",
            "source": f"{_DGXC}/nemotron/README_15b.md (NeMo 24.x launcher, {_LAUNCHER.format('15b')})",
            "published": published,
            "argv": [PROGRAM, *_NEMOTRON4_15B, *_layout(4, 1, 4, gbs), *_COMMON]}


def _n340(n: int, gbs: int, step_s: float, mfu: float, note: str | None = None) -> dict:
    row = {"name": f"nemotron4-340b-{n}", "model": "Nemotron-4 340B", "gpus": n, "gbs": gbs, "mbs": 1,
           "seq": 4096, "layout": "TP8 PP8 CP1 VP12 EP1", "precision": "BF16",
           "source": f"{_DGXC_340B} (NeMo 24.11; {_LAUNCHER.format('340b')}: sequence_parallel, "
                     "grad_sync_dtype bf16)",
           # the recipe's own formulas: its model FLOPs 1.01e16 per sequence
           "published": {"step_s": step_s, "tokens_per_s_per_gpu": round(4096 * gbs / step_s / n, 1),
                         "tflops_per_s_per_gpu": round(1.01e16 * gbs / step_s / n / 1e12, 1), "mfu": mfu},
           "argv": [PROGRAM, *_NEMOTRON4_340B, *_layout(8, 8, 1, gbs, vp=12), *_COMMON, "--grad-reduce-in-bf16"]}
    if note:
        row["note"] = note
    return row


ROWS: list[dict] = [
    # published weak scaling (GBS = 4 x N): training step 2.812 s at 16 GPUs ... 2.887 s at 2048 GPUs
    _n15(16, 64, 2.812, 0.6249),
    _n15(256, 1024, 2.852, 0.6162),
    _n15(2048, 8192, 2.887, 0.6087),
    # 6(b): the 16-GPU row's global batch at 4x the GPUs (strong scaling; no published figure)
    _n15(64, 64, None, None),
    _n340(128, 32, 4.61, 0.5538,
          note="does not fit: stage 0 runs out of the 80 GB in iteration 2 (see RESULTS.md and "
               "published/nemotron4-340b-128.oom.json)"),
    _n340(2048, 512, 4.84, 0.5275),
]


def run(row: dict) -> dict:
    os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    os.environ["PRISM_ATTENTION"] = "flash"  # the fused-attention stand-in in every profiling run
    os.chdir(ROOT)
    out = Path("/tmp") / f"prism_published_{row['name']}"
    report = emulate(row["argv"], world_size=row["gpus"], profile="dgx-h100", out=out, warmup=1,
                     progress=lambda text: print(f"[{row['name']}] {text}", flush=True))
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"{row['name']}.emulate.json").write_text(json.dumps(report, indent=1))
    return report


def failure_record(row: dict, error: str) -> Path | None:
    """``validation/published/<row>.oom.json`` when a profiling run ran out of the virtual GPU's memory: its device
    figures, the emulated steps it finished and Megatron's own theoretical footprint (from its log); None when
    the failed run left no summary or no OOM."""
    import re

    run_dir = Path("/tmp") / f"prism_published_{row['name']}"
    summaries = sorted(run_dir.glob("run*/rank*.summary.json"), key=lambda p: p.stat().st_mtime)
    if not summaries:
        return None
    summary = json.loads(summaries[-1].read_text())
    device = max(summary["virtual_gpu"]["devices"], key=lambda d: d["peak_allocated_bytes"])
    if not device["ooms"]:
        return None
    log = (summaries[-1].parent / "log.txt").read_text(errors="replace")
    theory = re.search(r"Theoretical memory footprints: weight and optimizer=([\d.]+) MB, activation=([\d.]+) MB, "
                       r"total=([\d.]+) MB", log)
    params = re.search(r"number of parameters on \(tensor, gtp_remat, pipeline\) model parallel rank [^:]*: (\d+)", log)
    record = {"row": row["name"], "world_size": row["gpus"], "rank": summary["rank"],
              "profiling_run": summaries[-1].parent.name,
              "result": f"profiling run {summaries[-1].parent.name} ran out of the virtual H100's memory in iteration "
                        f"{summary['iterations_marked']}; no graph, no prediction",
              "attention": summary["megatron"].get("attention", {}).get("implementation", "local"),
              "error": summary.get("error", error), "device": device,
              "emulated_step_s_before_the_oom": summary["virtual_gpu"]["virtual_time"]["step_times_s"],
              "megatron_theoretical_memory_MB": None if theory is None else dict(zip(
                  ("weight_and_optimizer", "activation", "total"), (float(x) for x in theory.groups()), strict=True)),
              "parameters_on_rank": None if params is None else int(params.group(1))}
    path = OUT / f"{row['name']}.oom.json"
    path.write_text(json.dumps(record, indent=1))
    return path


def table() -> list[str]:
    """Published vs predicted. The recipes' model-FLOP formula counts full multi-head attention projections
    (Nemotron-4 has 8 key/value groups), so their TFLOP/s is also restated on Megatron's
    ``num_floating_point_operations`` (the published tokens/s x Megatron's FLOPs per token), the formula
    the prediction uses; on that basis the TFLOP/s error equals the tokens/s error."""
    lines = ["| row | GPUs | GBS | published tok/s/GPU | predicted | error | published TFLOP/s/GPU (recipe formula / "
             "Megatron formula) | predicted (Megatron formula) | MFU published / predicted |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    errors = []
    for row in ROWS:
        path = OUT / f"{row['name']}.emulate.json"
        if not path.is_file():
            continue
        rep = json.loads(path.read_text())
        pub = row["published"]
        tok, tfl = rep["tokens_per_s_per_gpu"], rep["model_tflops_per_s_per_gpu"]
        if pub is None:
            lines.append(f"| {row['name']} | {row['gpus']} | {row['gbs']} | - | {tok} | - | - | {tfl} | "
                         f"- / {100 * rep['mfu']:.1f}% |")
            continue
        per_token = rep["model_flops_per_iteration"] / (rep["global_batch_size"] * rep["seq_length"])
        pub_meg = pub["tokens_per_s_per_gpu"] * per_token / 1e12
        e_tok = (tok - pub["tokens_per_s_per_gpu"]) / pub["tokens_per_s_per_gpu"]
        errors.append(abs(e_tok))
        lines.append(f"| {row['name']} | {row['gpus']} | {row['gbs']} | {pub['tokens_per_s_per_gpu']} | {tok} | "
                     f"{100 * e_tok:+.1f}% | {pub['tflops_per_s_per_gpu']} / {pub_meg:.1f} | {tfl} | "
                     f"{100 * pub_meg / H100_BF16_TFLOPS:.1f}% / {100 * rep['mfu']:.1f}% |")
    if errors:
        lines.append(f"\nmean |error| (tokens/s/GPU) over {len(errors)} rows: {100 * sum(errors) / len(errors):.1f}%")
    return lines


def _layout_text(row: dict[str, Any]) -> str:
    """``TP4 PP1 MBS4`` from ``TP4 PP1 CP1 VP- EP1``: TP and PP always, the others where they are not 1."""
    parts = [p for p in row["layout"].split() if p[:2] in ("TP", "PP") or p[2:] not in ("1", "-")]
    return " ".join([*parts, f"MBS{row['mbs']}"])


def _gib(n: int) -> float:
    return round(n / 2**30, 2)


def results_data(previous: dict[str, Any] | None = None, *, conditions: str | None = None) -> dict[str, Any]:
    """``validation/results/published_h100.json`` from the reports in `OUT`: one row per row of `ROWS` that has a
    report (or an out-of-memory record), published vs predicted, and each class of ranks' time and memory.
    ``conditions`` (the host during the runs) None: the run's date, conditions, sources and notes are kept from
    ``previous`` (the table alone, from the reports of that run)."""
    rows: list[dict[str, Any]] = []
    classes: list[dict[str, Any]] = []
    for row in ROWS:
        pub = row["published"]
        label = f"{row['model'].split()[-1]}, {row['gpus']} GPUs" + ("" if pub else f", GBS {row['gbs']}")
        entry: dict[str, Any] = {
            "row": row["name"], "model": row["model"], "role": "validate" if pub else "report", "gpus": row["gpus"],
            "gbs": row["gbs"], "layout": _layout_text(row),
            "published_tokens_per_s_per_gpu": pub and pub["tokens_per_s_per_gpu"],
            "predicted_tokens_per_s_per_gpu": None, "error_pct": None,
            "published_tflops_recipe": pub and pub["tflops_per_s_per_gpu"], "published_tflops_megatron": None,
            "predicted_tflops": None, "published_mfu_pct": None, "predicted_mfu_pct": None, "profiling_wall_s": None}
        report, oom = OUT / f"{row['name']}.emulate.json", OUT / f"{row['name']}.oom.json"
        if report.is_file():
            rep = json.loads(report.read_text())
            tok = rep["tokens_per_s_per_gpu"]
            entry.update(predicted_tokens_per_s_per_gpu=tok, predicted_tflops=rep["model_tflops_per_s_per_gpu"],
                         predicted_mfu_pct=round(100 * rep["mfu"], 1),
                         profiling_wall_s=round(sum(c["profiling_run_wall_s"] for c in rep["classes"])))
            if pub is not None:
                per_token = rep["model_flops_per_iteration"] / (rep["global_batch_size"] * rep["seq_length"])
                megatron = pub["tokens_per_s_per_gpu"] * per_token / 1e12
                entry.update(error_pct=round(100 * (tok / pub["tokens_per_s_per_gpu"] - 1), 2),
                             published_tflops_megatron=round(megatron, 1),
                             published_mfu_pct=round(100 * megatron / H100_BF16_TFLOPS, 1))
            else:
                entry["note"] = "no published figure"
            if rep["profiling_runs"] > 1:
                entry["profiling_note"] = f"{rep['profiling_runs']} runs"
            for c in rep["classes"]:
                classes.append({"row": label, "class": "all" if len(rep["classes"]) == 1 else c["class"],
                                "step_ms": round(c["step_ms"], 1), "compute_ms": round(c["compute_ms"], 1),
                                "exposed_comm_ms": round(c["exposed_comm_ms"], 1),
                                "bubble_ms": round(c["bubble_ms"], 1),
                                "peak_allocated_gib": _gib(c["peak_allocated_bytes"]),
                                "peak_reserved_gib": _gib(c["peak_reserved_bytes"]),
                                "device_total_gib": _gib(c["device_total_bytes"])})
        elif oom.is_file():
            record = json.loads(oom.read_text())
            device = record["device"]
            failed = device["ooms"][0]["alloc_size"] / 2**20
            entry.update(note="does not fit", profiling_note=f"OOM in {record['profiling_run'].replace('run', 'run ')}")
            classes.append({"row": label, "class": f"rank {record['rank']}", "step_ms": None, "compute_ms": None,
                            "exposed_comm_ms": None, "bubble_ms": None,
                            "peak_allocated_gib": _gib(device["peak_allocated_bytes"]),
                            "peak_allocated_note": f"then a {failed:.0f} MiB request fails (iteration "
                                                   f"{len(record['emulated_step_s_before_the_oom']) + 1})",
                            "peak_reserved_gib": _gib(device["peak_reserved_bytes"]),
                            "device_total_gib": _gib(device["device_total_bytes"])})
        else:
            continue
        rows.append(entry)
    data: dict[str, Any] = {
        "source": "published_h100", "date": datetime.now(UTC).date().isoformat(),
        "command": ".venv/bin/python validation/published_h100.py --write-results",
        "conditions": conditions or "not recorded",
        "fitting": "Nothing fitted: the dgx-h100 profile's own efficiency estimates; every row with a published "
                   "figure is a validation row.",
        "sources": list(dict.fromkeys(f"{r['model']}: {r['source']}" for r in ROWS)), "rows": rows,
        "classes": classes}
    if conditions is None and previous:
        data.update({k: previous[k] for k in ("date", "conditions", "sources", "notes") if k in previous})
    return data


def _write_results(conditions: str | None) -> None:
    path = DATA_DIR / "published_h100.json"
    previous = json.loads(path.read_text()) if path.is_file() else None
    print(f"wrote {write_source('published_h100', results_data(previous, conditions=conditions))} and "
          "recipes/RESULTS.md", file=sys.stderr)


def main(argv: list[str]) -> int:
    write = "--write-results" in argv
    argv = [a for a in argv if a != "--write-results"]
    if argv == ["--table"]:
        print("\n".join(table()))
        if write:
            _write_results(None)
        return 0
    chosen = [r for r in ROWS if not argv or r["name"] in argv]
    load_before = os.getloadavg()[0]
    for row in chosen:
        try:
            run(row)
        except RuntimeError as exc:  # a profiling run failed (e.g. out of memory): report and go on
            print(f"[{row['name']}] failed: {str(exc).splitlines()[0]}", file=sys.stderr)
            record = failure_record(row, str(exc).splitlines()[0])
            if record is not None:
                print(f"[{row['name']}] out of memory: {record}", file=sys.stderr)
    print("\n".join(table()))
    if write:
        _write_results(f"`prism emulate` (one at a time) on a host of {os.cpu_count()} CPU cores, 1-minute load "
                       f"average {load_before:.2f} before and {os.getloadavg()[0]:.2f} after the runs of "
                       f"{', '.join(r['name'] for r in chosen)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
