"""The corpus's rows: one data file each, with its source, what was measured, the prism command, and a role.

Two kinds, one `Row` each:

- ``throughput``: a published, measured training throughput of a full-size job (``validation/corpus/rows/*.yaml``),
  predicted by ``prism emulate`` (`THROUGHPUT_FIELDS` lists the file's fields);
- ``functional``: a Megatron-LM functional-test case with NVIDIA's golden values
  (``validation/megatron_functional/cases/*.yaml``, written by `validation.megatron_functional.collect`),
  predicted by the drop-in as the case's last rank, or with a pipeline by ``prism emulate`` (every stage: the
  last one waits for the others).

A file is checked when it loads: every field present and of its type, the role ``fit`` or ``validate``, the layout
dividing the GPUs and the batch, and the command's parallelism, batch and sequence flags equal to the layout the
source gives. A bad file raises `RowError` naming the file, the field and the fix.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

__all__ = ["FUNCTIONAL_DIR", "ROLES", "ROWS_DIR", "THROUGHPUT_FIELDS", "Row", "RowError", "load_rows",
           "throughput_row"]

ROWS_DIR = Path(__file__).resolve().parent / "rows"
FUNCTIONAL_DIR = Path(__file__).resolve().parents[1] / "megatron_functional" / "cases"
ROLES = ("fit", "validate")
PRECISIONS = ("bf16", "fp8")
THROUGHPUT_FIELDS = {"name": str, "role": str, "model": str, "source": Mapping, "hardware": Mapping,
                     "precision": str, "gpus": int, "layout": Mapping, "measured": Mapping, "argv": list}
"""Required fields of a throughput row file and their types; ``notes`` (a list) and ``env`` (a mapping of the
runs' environment variables) are optional."""
_OPTIONAL = {"notes": list, "env": Mapping}
_LAYOUT = ("tp", "pp", "cp", "vp", "ep", "mbs", "gbs", "seq")
_MEASURED = ("tokens_per_s_per_gpu", "model_tflops_per_s_per_gpu", "step_s")
_LAYOUT_FLAGS = {"tp": "--tensor-model-parallel-size", "pp": "--pipeline-model-parallel-size",
                 "cp": "--context-parallel-size", "vp": "--num-virtual-stages-per-pipeline-rank",
                 "ep": "--expert-model-parallel-size", "mbs": "--micro-batch-size", "gbs": "--global-batch-size",
                 "seq": "--seq-length"}
_FLAG_DEFAULTS = {"tp": 1, "pp": 1, "cp": 1, "vp": None, "ep": 1}
"""Megatron's value of a layout flag the command leaves out."""


class RowError(ValueError):
    """A corpus row file that cannot be used: the message names the file, the field and the fix."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Row:
    """One row of the corpus, either kind: what was measured, and how prism predicts it."""

    name: str
    kind: Literal["throughput", "functional"]
    role: Literal["fit", "validate"]
    model: str
    source: str
    """Where the measured figures come from: a URL, or a repository file at a commit."""
    gpus: int
    precision: str
    layout: str
    """``TP4 PP8 VP6 MBS1 GBS256 seq 2048``: TP and PP always, the others where they are not 1."""
    measured_step_s: float | None
    """The measured step (iteration) time: printed by the source, or for a throughput row that prints only
    tokens/s/GPU, ``seq x GBS / (tokens/s/GPU x GPUs)`` (`measured_step_derived`)."""
    measured_step_derived: bool = False
    measured_tokens_per_s_per_gpu: float | None = None
    measured_peak_allocated_bytes: int | None = None
    argv: tuple[str, ...] = ()
    """The job's program and its arguments (the part after ``--`` of the prism command)."""
    env: Mapping[str, str] = field(default_factory=dict)
    path: Path | None = None
    data: Mapping[str, Any] = field(default_factory=dict)
    """The file as loaded."""

    @property
    def command(self) -> str:
        """The exact prism command that predicts this row (environment first)."""
        if self.kind == "throughput":
            head = [f"prism emulate --world-size {self.gpus} --profile {self.data['hardware']['profile']} "
                    f"--output /tmp/prism_corpus/{self.name} --overwrite --", *self.argv]
        elif _pipelined(self.data):  # a pipeline's case: its stages through prism emulate (the bubble)
            from validation.megatron_functional.run import command

            head = ["prism", *command(dict(self.data), Path("/tmp/prism_corpus/functional") / self.name)[3:]]
        else:
            head = ["python -m prism_plugin.megatron", *self.argv, f"--prism-world-size {self.gpus} --prism-real-ranks "
                    f"{self.data['rank']} --prism-profile dgx-h100 --prism-device virtual-gpu"]
        return " ".join([*(f"{k}={v}" for k, v in self.env.items()), *head])

def _pipelined(data: Mapping[str, Any]) -> bool:
    from validation.megatron_functional.run import pipelined

    return pipelined(dict(data))


def _error(path: Path, key: str, problem: str, fix: str) -> RowError:
    return RowError(f"{path}: field `{key}` {problem}; {fix}")


def _flag_value(argv: Sequence[str], flag: str) -> str | None:
    """The value after the last ``flag`` in ``argv`` (None: absent)."""
    value = None
    for i, item in enumerate(argv[:-1]):
        if item == flag:
            value = argv[i + 1]
    return value


def throughput_row(data: Any, path: Path) -> Row:
    """Check one throughput row file's data (`RowError` naming the field and the fix) and make its `Row`."""
    if not isinstance(data, Mapping):
        raise RowError(f"{path}: a row file is a mapping of the fields {', '.join(THROUGHPUT_FIELDS)}")
    for key, kind in THROUGHPUT_FIELDS.items():
        if key not in data:
            raise _error(path, key, "is missing", f"add it ({kind.__name__}); see validation/corpus/README.md")
        if not isinstance(data[key], kind) or isinstance(data[key], bool):
            raise _error(path, key, f"is {data[key]!r}", f"it must be a {kind.__name__}")
    for key in data:
        if key not in THROUGHPUT_FIELDS and key not in _OPTIONAL:
            fields = ", ".join([*THROUGHPUT_FIELDS, *_OPTIONAL])
            raise _error(path, key, "is not a row field", f"the fields are {fields}")
    if data["name"] != path.stem:
        raise _error(path, "name", f"is {data['name']!r} but the file is {path.name}",
                     f"name the file {data['name']}.yaml")
    if data["role"] not in ROLES:
        raise _error(path, "role", f"is {data['role']!r}", "use fit (fitting may use it) or validate")
    if data["precision"] not in PRECISIONS:
        raise _error(path, "precision", f"is {data['precision']!r}", f"use one of {', '.join(PRECISIONS)}")
    for key in ("url", "table", "software"):
        if not isinstance(data["source"].get(key), str):
            raise _error(path, f"source.{key}", "is missing", "say where the figures are published")
    if not isinstance(data["hardware"].get("profile"), str):
        raise _error(path, "hardware.profile", "is missing", "name the hardware profile, e.g. dgx-h100")
    layout = {k: data["layout"].get(k, _FLAG_DEFAULTS.get(k)) for k in _LAYOUT}
    for key, value in layout.items():
        if key == "vp" and value in (None, 1):
            layout[key] = None
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise _error(path, f"layout.{key}", f"is {value!r}", "it must be a positive integer")
    gpus, model_parallel = data["gpus"], layout["tp"] * layout["pp"] * layout["cp"]
    if gpus < 1 or gpus % model_parallel:
        raise _error(path, "gpus", f"({gpus}) is not a multiple of tp x pp x cp = {model_parallel}",
                     "give the source's GPU count and layout")
    dp = gpus // model_parallel
    if layout["gbs"] % (layout["mbs"] * dp):
        raise _error(path, "layout.gbs", f"({layout['gbs']}) is not a multiple of mbs x dp = {layout['mbs']} x {dp}",
                     "give the source's batch sizes")
    argv = data["argv"]
    if not argv or not all(isinstance(a, str) for a in argv):
        raise _error(path, "argv", "must be a list of strings", "quote numbers: '96'")
    for key, flag in _LAYOUT_FLAGS.items():
        given = _flag_value(argv, flag)
        command = _FLAG_DEFAULTS.get(key) if given is None else int(given)
        if command != layout[key]:
            raise _error(path, "argv", f"has {flag} {given} but layout.{key} is {layout[key]}",
                         f"make them agree ({flag} {layout[key]})")
    fp8 = "--fp8-format" in argv
    if fp8 != (data["precision"] == "fp8"):
        raise _error(path, "argv", f"{'has' if fp8 else 'lacks'} --fp8-format but precision is {data['precision']}",
                     "make them agree")
    measured = data["measured"]
    for key, value in measured.items():
        if key not in _MEASURED:
            raise _error(path, f"measured.{key}", "is not a measured figure", f"use {', '.join(_MEASURED)}")
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise _error(path, f"measured.{key}", f"is {value!r}", "it must be a number > 0")
    tokens, step = measured.get("tokens_per_s_per_gpu"), measured.get("step_s")
    if tokens is None and step is None:
        raise _error(path, "measured", "has neither tokens_per_s_per_gpu nor step_s",
                     "give the figure the source prints")
    derived = step is None
    if step is None:
        step = layout["seq"] * layout["gbs"] / (tokens * gpus)
    env = data.get("env") or {}
    parts = [f"TP{layout['tp']}", f"PP{layout['pp']}",
             *(f"{k.upper()}{layout[k]}" for k in ("cp", "vp", "ep") if layout[k] not in (None, 1)),
             f"MBS{layout['mbs']}", f"GBS{layout['gbs']}", f"seq {layout['seq']}"]
    return Row(name=data["name"], kind="throughput", role=data["role"], model=data["model"],
               source=f"{data['source']['url']} ({data['source']['table']}; {data['source']['software']})",
               gpus=gpus, precision=data["precision"], layout=" ".join(parts), measured_step_s=float(step),
               measured_step_derived=derived, measured_tokens_per_s_per_gpu=tokens, argv=tuple(argv),
               env={str(k): str(v) for k, v in env.items()}, path=path, data=dict(data))


def functional_row(data: Mapping[str, Any], path: Path) -> Row:
    """A Megatron-LM functional-test case (`validation.megatron_functional.collect`'s file) as a row."""
    from validation.megatron_functional.run import program_argv

    args = data["args"]
    argv = program_argv(dict(data))
    precision = "fp8" if "--fp8-format" in args else "bf16" if "--bf16" in args else \
        "fp16" if "--fp16" in args else "fp32"
    layout = " ".join(f"{name}{args.get(flag, 1)}" for name, flag in
                      (("TP", "--tensor-model-parallel-size"), ("PP", "--pipeline-model-parallel-size")))
    source = data["source"]
    measured = data["measured"]
    if data.get("role") not in ROLES:
        raise _error(path, "role", f"is {data.get('role')!r}", "use fit or validate")
    return Row(name=data["case"], kind="functional", role=data["role"], model=str(data.get("model", "gpt")),
               source=f"{source['repo']} {source['golden_values']} @ {source['commit'][:12]}",
               gpus=int(data["world_size"]), precision=precision, layout=layout,
               measured_step_s=float(measured["iteration_time_s"]),
               measured_peak_allocated_bytes=int(measured["peak_allocated_bytes"]), argv=tuple(argv),
               env={str(k): str(v) for k, v in (data.get("env") or {}).items()}, path=path, data=dict(data))


def load_rows(patterns: Sequence[str] | None = None, *, rows_dir: Path = ROWS_DIR,
              functional_dir: Path = FUNCTIONAL_DIR) -> list[Row]:
    """Every row of the corpus (throughput rows, then functional ones, each by name), or those whose name matches
    one of ``patterns`` (names or shell globs; a pattern matching none raises `RowError`)."""
    rows = [throughput_row(yaml.safe_load(p.read_text()), p) for p in sorted(rows_dir.glob("*.yaml"))]
    rows += [functional_row(yaml.safe_load(p.read_text()), p) for p in sorted(functional_dir.glob("*.yaml"))]
    names = [r.name for r in rows]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise RowError(f"two rows are named {', '.join(duplicates)}; rename one file")
    if not patterns:
        return rows
    unknown = [p for p in patterns if not any(fnmatch.fnmatchcase(r.name, p) for r in rows)]
    if unknown:
        raise RowError(f"no row matches {', '.join(unknown)}; `python -m validation.corpus list` lists the rows")
    return [r for r in rows if any(fnmatch.fnmatchcase(r.name, p) for p in patterns)]
