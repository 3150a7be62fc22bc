"""Write ``cases/<case>.yaml`` from a clone of Megatron-LM: the rows of the functional-test validation.

    python -m validation.megatron_functional.collect --megatron-repo PATH [--branch core_r0.19.0]

PATH is a git directory of https://github.com/NVIDIA/Megatron-LM (a bare mirror works: files are read with
``git show <branch>:<path>``). A row is written for each case that

- lies under ``tests/functional_tests/test_cases/{gpt,moe}/`` and whose name does not end in ``_memory_speed``
  (those directories are filtered out by name before any file is read: they are kept aside for an independent
  check);
- is listed in the H100 launch recipe of its model (``tests/test_utils/recipes/h100/{gpt,moe}.yaml``: one node
  of 8 GPUs, launched with ``pretrain_gpt.py``), so its world size is known (``source.ci_scope``: the CI scopes
  the recipe lists it in; ``mr-broken`` is NVIDIA's own mark of a case that does not pass on the branch);
- has ``golden_values_dev_dgx_h100.json`` holding both ``mem-max-allocated-bytes`` and ``iteration-time``.

What each figure is (also written at the top of every row file):

- ``measured.peak_allocated_bytes``: ``mem-max-allocated-bytes`` at the first logged step >= ``TRAIN_ITERS``
  (step 3 when every step is logged, step 6 when every fifth is). Megatron's ``training_log`` writes
  ``torch.cuda.memory_stats()["allocated_bytes.all.peak"]`` there on the last rank (the only rank with a
  TensorBoard writer); the peak is never reset, so the value at step k is the peak over iterations 1..k.
  ``peak_allocated_bytes_by_step`` keeps the logged steps up to that one and ``peak_allocated_bytes_last`` the
  value at the last logged step (a checkpoint save or resume can add to it later in the run). With ``--fp16``
  the step is instead the first one whose value rises past step 2's (step 17 or 18 in these cases): dynamic loss
  scaling starts at 2^32 and skips the optimizer step while the gradients overflow, so the optimizer state is
  allocated only at the first step it applies, while prism's value policy finds no overflow and steps at
  iteration 1.
- ``measured.iteration_time_s``: the statistic Megatron's own check compares (``python_test_utils/common.py``,
  ``pipeline``): the median of ``iteration-time`` over the steady window, steps 5..20 when the golden values
  end at step 25 or earlier, else steps 30..45. ``iteration-time`` is the elapsed time of the logging
  interval divided by its iterations (``--log-interval 1`` in these cases: one iteration each).

The arguments are the case's ``MODEL_ARGS`` with the changes listed in the row's ``replaced``: data,
tokenizer, checkpoint and TensorBoard paths removed; ``--mock-data --tokenizer-type NullTokenizer
--vocab-size`` the case's own vocabulary size, else 50257 (the GPT-2 BPE vocabulary of the cases'
``bpe/vocab.json``, the size the one NullTokenizer case states); ``--train-iters`` `TRAIN_ITERS`;
``--eval-iters 0`` (the figures are training iterations').

The split (`role`), declared before anything was fitted on these rows: the cases sorted by name, every third
one from the first is a ``fit`` row, the rest ``validate``. The host time per launch of the hardware profile
is fitted on the fit rows' iteration times only (`validation.megatron_functional.fit`); the validate rows are
never read for it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
from pathlib import Path
from typing import Any

import yaml

__all__ = ["CASES_DIR", "TRAIN_ITERS", "DEFAULT_VOCAB_SIZE", "HOLDOUT_SUFFIX", "FIT_EVERY", "case_names",
           "convert_args", "measured_figures", "role", "collect"]

CASES_DIR = Path(__file__).resolve().parent / "cases"
SOURCE_REPO = "https://github.com/NVIDIA/Megatron-LM"
DEFAULT_BRANCH = "core_r0.19.0"
TEST_CASES = "tests/functional_tests/test_cases"
RECIPE = "tests/test_utils/recipes/h100/{model}.yaml"
GOLDEN = "golden_values_dev_dgx_h100.json"
MODELS = ("gpt", "moe")
FIT_EVERY = 3
"""Every third case by name, from the first, is a fit row (`role`)."""
HOLDOUT_SUFFIX = "_memory_speed"
TRAIN_ITERS = 3
DEFAULT_VOCAB_SIZE = 50257  # GPT-2 BPE vocab.json: 50257 entries

# Flags removed from MODEL_ARGS, with why. Paths name files on NVIDIA's CI cluster; the checkpoint flags
# act only with --save / --load, which a virtual GPU refuses (a checkpoint of fake tensors holds no values).
_REMOVED = {
    "--data-path": "data path: --mock-data instead",
    "--data-cache-path": "data path: --mock-data instead",
    "--vocab-file": "tokenizer file: NullTokenizer instead",
    "--merge-file": "tokenizer file: NullTokenizer instead",
    "--tokenizer-type": "tokenizer: NullTokenizer instead",
    "--tokenizer-model": "tokenizer file: NullTokenizer instead",
    "--tensorboard-dir": "TensorBoard path: the figures are read from prism's summary",
    "--save": "checkpoint path: not saved",
    "--load": "checkpoint path: not loaded",
    "--save-interval": "no checkpoint is saved",
    "--async-save": "no checkpoint is saved",
    "--use-persistent-ckpt-worker": "no checkpoint is saved",
    "--async-ckpt-use-cpu-shm": "no checkpoint is saved",
    "--exit-interval": f"the run stops at --train-iters {TRAIN_ITERS}",
    "--fim-data": "data only: fill-in-the-middle reorders tokens of real documents (Megatron refuses it with mock "
                  "data); the model, its tensors and its kernels are the same",
    "--fim-rate": "data only (see --fim-data)",
    "--fim-spm-rate": "data only (see --fim-data)",
}


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout


def case_names(repo: Path, branch: str, model: str) -> list[str]:
    """The case directories of ``model``, the ``_memory_speed`` ones left out by name (nothing of theirs read)."""
    names = _git(repo, "ls-tree", "--name-only", f"{branch}:{TEST_CASES}/{model}").split()
    return sorted(n for n in names if not n.endswith(HOLDOUT_SUFFIX))


def _recipe(repo: Path, branch: str, model: str) -> tuple[int, dict[str, list[str]]]:
    """World size (nodes x gpus of the recipe's spec) and the non-held-out cases the recipe launches, each with the
    CI scopes its products list (``mr``, ``nightly``, ... ; ``mr-broken``: NVIDIA's CI lists it as broken)."""
    recipe = yaml.safe_load(_git(repo, "show", f"{branch}:{RECIPE.format(model=model)}"))
    spec = recipe["spec"]
    listed: dict[str, set[str]] = {}
    for product in recipe["products"]:
        scopes = {str(s) for entry in product.get("products") or [] for s in entry.get("scope") or []}
        for name in product["test_case"]:
            if not name.endswith(HOLDOUT_SUFFIX):
                listed.setdefault(name, set()).update(scopes)
    return int(spec["nodes"]) * int(spec["gpus"]), {name: sorted(s) for name, s in listed.items()}


def convert_args(model_args: dict[str, str], *, train_iters: int = TRAIN_ITERS,
                 default_vocab_size: int = DEFAULT_VOCAB_SIZE) -> tuple[dict[str, str | bool | list[str]], list[str]]:
    """The case's MODEL_ARGS (every value a string, as `yaml.BaseLoader` reads them) as drop-in arguments.

    Returns the arguments (flag -> value, as the CI's ``_run_training.sh`` passes them: ``True`` for a switch
    (a ``true`` value), a list of words for a value in brackets) and the list of changes, one line each.
    """
    args: dict[str, str | bool | list[str]] = {}
    replaced: list[str] = []
    for flag, value in model_args.items():
        if flag in _REMOVED:
            replaced.append(f"{flag} {value}: removed ({_REMOVED[flag]})")
            continue
        if value == "true":
            args[flag] = True
        elif value.startswith("[") and value.endswith("]"):  # the CI strips the brackets and passes the words
            args[flag] = value[1:-1].split()
        else:
            args[flag] = value
    vocab = model_args.get("--vocab-size", str(default_vocab_size))
    if "--vocab-size" not in model_args:
        replaced.append(f"--vocab-size {vocab}: added (NullTokenizer of the cases' GPT-2 BPE vocabulary)")
    args["--mock-data"] = True
    args["--tokenizer-type"] = "NullTokenizer"
    args["--vocab-size"] = vocab
    replaced.append("--mock-data --tokenizer-type NullTokenizer: added")
    replaced.append(f"--train-iters {model_args['--train-iters']} -> {train_iters}")
    args["--train-iters"] = str(train_iters)
    if model_args.get("--eval-iters", "0") != "0":
        replaced.append(f"--eval-iters {model_args['--eval-iters']} -> 0 (the figures are training iterations')")
    args["--eval-iters"] = "0"
    return args, replaced


def _numeric(values: dict[str, Any]) -> dict[int, float]:
    return {int(k): float(v) for k, v in values.items() if not isinstance(v, str)}


def measured_figures(golden: dict[str, Any], *, train_iters: int = TRAIN_ITERS,
                     fp16: bool = False) -> dict[str, Any]:
    """The two figures of one golden-values file (see the module docstring for the statistics)."""
    mem = _numeric(golden["mem-max-allocated-bytes"]["values"])
    step = min(s for s in mem if s >= train_iters)
    if fp16:  # the first step whose peak rises past step 2's: the first optimizer step dynamic loss scaling applies
        risen = [s for s in sorted(mem) if s > 2 and mem[s] > mem.get(2, mem[min(mem)])]
        step = risen[0] if risen else step
    times = _numeric(golden["iteration-time"]["values"])
    last = max(int(k) for k in golden["iteration-time"]["values"])
    window = range(5, 21) if last <= 25 else range(30, 46)
    steady = [t for s, t in times.items() if s in window]
    return {
        "peak_allocated_bytes": int(mem[step]),
        "peak_allocated_bytes_step": step,
        "peak_allocated_bytes_by_step": {s: int(v) for s, v in sorted(mem.items()) if s <= step},
        "peak_allocated_bytes_last": int(mem[max(mem)]),
        "last_logged_step": max(mem),
        "iteration_time_s": round(statistics.median(steady), 6),
        "iteration_time_statistic": f"median of iteration-time over logged steps {window.start}..{window.stop - 1}"
                                    f" ({len(steady)} values)",
    }


_FP16_NOTE = " (fp16: the first applied optimizer step)"
_HEADER = """\
# Megatron-LM functional test {case} on DGX H100: a {role} row ({role_note}).
# Written by `python -m validation.megatron_functional.collect` from {repo} branch {branch} ({commit}).
# measured.peak_allocated_bytes: the golden values' mem-max-allocated-bytes at step {step}{why}, logged by the last rank
#   (torch.cuda.memory_stats()["allocated_bytes.all.peak"], a running peak: the value at step k covers steps 1..k).
# measured.iteration_time_s: {statistic}, as Megatron's check compares it.
# args: the case's MODEL_ARGS with the changes in `replaced`; env: its ENV_VARS; world_size: its H100 recipe's
#   nodes x gpus; rank: the last rank, which logged both figures.
"""


_ROLE_NOTES = {"fit": "the host time per launch is fitted on its iteration time",
               "validate": "nothing is fitted on it"}


def role(case: str, cases: list[str]) -> str:
    """``fit`` for every `FIT_EVERY`-th of `cases` sorted by name, from the first; ``validate`` for the rest.

    >>> [role(c, ["a", "b", "c", "d"]) for c in "abcd"]
    ['fit', 'validate', 'validate', 'fit']
    """
    return "fit" if sorted(cases).index(case) % FIT_EVERY == 0 else "validate"


def _row(repo: Path, branch: str, commit: str, model: str, case: str, world_size: int,
         scopes: list[str]) -> dict[str, Any] | None:
    base = f"{TEST_CASES}/{model}/{case}"
    try:
        golden = json.loads(_git(repo, "show", f"{branch}:{base}/{GOLDEN}"))
    except subprocess.CalledProcessError:
        return None
    if "mem-max-allocated-bytes" not in golden or "iteration-time" not in golden:
        return None
    config = yaml.load(_git(repo, "show", f"{branch}:{base}/model_config.yaml"), Loader=yaml.BaseLoader)
    args, replaced = convert_args(config["MODEL_ARGS"])
    return {
        "case": case,
        "model": model,
        "role": "validate",  # `collect` sets the split once every case is known
        "hardware": "DGX H100 (8x H100 80GB SXM)",
        "source": {"repo": SOURCE_REPO, "branch": branch, "commit": commit, "golden_values": f"{base}/{GOLDEN}",
                   "model_config": f"{base}/model_config.yaml", "launch": RECIPE.format(model=model),
                   "ci_scope": scopes},
        "test_type": config.get("TEST_TYPE", "regular"),
        "world_size": world_size,
        "rank": world_size - 1,
        "train_iters": TRAIN_ITERS,
        "measured": measured_figures(golden, fp16=config["MODEL_ARGS"].get("--fp16") == "true"),
        "env": dict(config.get("ENV_VARS") or {}),
        "args": args,
        "replaced": replaced,
    }


def collect(repo: Path, branch: str = DEFAULT_BRANCH, out_dir: Path = CASES_DIR) -> list[str]:
    """Write one row file per selected case; returns the cases written."""
    commit = _git(repo, "rev-parse", branch).strip()
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for model in MODELS:
        world_size, launched = _recipe(repo, branch, model)
        for case in case_names(repo, branch, model):
            if case not in launched:
                continue
            row = _row(repo, branch, commit, model, case, world_size, launched[case])
            if row is not None:
                rows.append(row)
    names = [row["case"] for row in rows]
    written = []
    for row in rows:
        case = row["case"]
        row["role"] = role(case, names)
        header = _HEADER.format(case=case, role=row["role"], role_note=_ROLE_NOTES[row["role"]],
                                repo=SOURCE_REPO, branch=branch, commit=commit,
                                step=row["measured"]["peak_allocated_bytes_step"],
                                why=_FP16_NOTE if row["args"].get("--fp16") else "",
                                statistic=row["measured"]["iteration_time_statistic"])
        body = yaml.safe_dump(row, sort_keys=False, width=120, default_flow_style=False)
        (out_dir / f"{case}.yaml").write_text(header + body)
        written.append(case)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megatron-repo", type=Path, required=True, help="git directory of NVIDIA/Megatron-LM")
    parser.add_argument("--branch", default=DEFAULT_BRANCH)
    parser.add_argument("--out", type=Path, default=CASES_DIR)
    ns = parser.parse_args(argv)
    written = collect(ns.megatron_repo, ns.branch, ns.out)
    print(f"{len(written)} rows written to {ns.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
