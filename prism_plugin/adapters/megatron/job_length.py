"""``--prism-iterations K``: emulate the first K iterations of a long job (Megatron's drop-in).

A launch script states its whole run (GPT-3 175B's example: ``--train-iters 500000``). Megatron sizes its
datasets for the whole run before the first iteration (train samples = iterations x global batch: 768 million
samples there, whose mock-data index alone took over 3 GB and minutes of host time here before any iteration ran),
and an emulation needs a few iterations. `shorten` rewrites the length the job states to K:

- ``--train-iters N`` becomes ``--train-iters K`` (K < N); ``--train-samples S`` becomes K x the global batch;
- the learning-rate schedule stays the job's: when the job leaves ``--lr-decay-iters`` (``--lr-decay-samples``)
  unset, Megatron decays over the whole run, so the original length is passed there; warm-up given as a fraction
  is a fraction of that length, so it stays too;
- when no evaluation falls in the first K iterations (K below ``--eval-interval``), ``--eval-iters 0``: Megatron
  evaluates at the end of training, which the job at iteration K would not (GPT-3 175B's: 10 forward-only
  iterations of 192 micro-batches after the 2 trained);
- everything else is unchanged: the run ends as Megatron ends one at ``--train-iters`` (a final checkpoint save when
  the job saves: emulated on virtual GPUs, nothing written).

One line says what was shortened. K at or beyond the job's own length changes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prism_plugin.adapters.megatron.absent_data import Substitution
from prism_plugin.adapters.megatron.argv import flag_values, without_flags

__all__ = ["shorten"]


def shorten(argv: Sequence[str], namespace: Any, iterations: int) -> Substitution:
    """`argv` (the script's Megatron arguments, `namespace` Megatron's parse of them) running `iterations`
    iterations."""
    argv = list(argv)
    train_iters = getattr(namespace, "train_iters", None)
    train_samples = getattr(namespace, "train_samples", None)
    if train_iters is not None and iterations < train_iters:
        out = without_flags(argv, ("--train-iters",)) + ["--train-iters", str(iterations)]
        if getattr(namespace, "lr_decay_iters", None) is None and not flag_values(argv, "--lr-decay-samples"):
            out += ["--lr-decay-iters", str(train_iters)]
        out, said = _no_final_evaluation(out, namespace, iterations)
        return Substitution(out, f"prism: --prism-iterations {iterations}: the emulation trains the first "
                                 f"{iterations} of the job's {train_iters} iterations (--train-iters {iterations}; "
                                 f"the learning-rate schedule is the job's{said})")
    if train_samples is not None:
        samples = iterations * int(namespace.global_batch_size)
        if samples >= train_samples:
            return Substitution(argv, None)
        out = without_flags(argv, ("--train-samples",)) + ["--train-samples", str(samples)]
        if getattr(namespace, "lr_decay_samples", None) is None:
            out += ["--lr-decay-samples", str(train_samples)]
        out, said = _no_final_evaluation(out, namespace, iterations)
        return Substitution(out, f"prism: --prism-iterations {iterations}: the emulation trains the first {samples} "
                                 f"of the job's {train_samples} samples (--train-samples {samples}; the "
                                 f"learning-rate schedule is the job's{said})")
    return Substitution(argv, None)


def _no_final_evaluation(argv: list[str], namespace: Any, iterations: int) -> tuple[list[str], str]:
    """`argv` with ``--eval-iters 0`` when the job evaluates but not within its first `iterations`."""
    interval = getattr(namespace, "eval_interval", None)
    if not getattr(namespace, "eval_iters", 0) or interval is None or iterations >= interval:
        return argv, ""
    return (without_flags(argv, ("--eval-iters",)) + ["--eval-iters", "0"],
            f"; no evaluation: its first is at iteration {interval}, --eval-iters 0")
