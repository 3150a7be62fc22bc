"""``--prism-iterations K``: a long job's stated length rewritten to its first K iterations, its schedule kept."""

from __future__ import annotations

from types import SimpleNamespace

from prism_plugin.adapters.megatron.job_length import shorten

JOB = ["--num-layers", "96", "--train-iters", "500000", "--lr-warmup-fraction", ".001", "--global-batch-size", "1536"]


def _ns(**kw: object) -> SimpleNamespace:
    base = {"train_iters": None, "train_samples": None, "lr_decay_iters": None, "lr_decay_samples": None,
            "global_batch_size": 1536, "eval_iters": 0, "eval_interval": None}
    return SimpleNamespace(**{**base, **kw})


def test_train_iters_becomes_k_and_the_decay_keeps_the_jobs_length() -> None:
    out = shorten(JOB, _ns(train_iters=500000), 2)
    assert out.argv == ["--num-layers", "96", "--lr-warmup-fraction", ".001", "--global-batch-size", "1536",
                        "--train-iters", "2", "--lr-decay-iters", "500000"]
    assert out.note is not None and "first 2 of the job's 500000 iterations" in out.note


def test_a_stated_decay_is_left_as_the_job_states_it() -> None:
    out = shorten([*JOB, "--lr-decay-iters", "430000"], _ns(train_iters=500000, lr_decay_iters=430000), 3)
    assert out.argv[-4:] == ["--lr-decay-iters", "430000", "--train-iters", "3"]


def test_train_samples_become_k_global_batches() -> None:
    argv = ["--train-samples", "1000000", "--global-batch-size", "1536"]
    out = shorten(argv, _ns(train_samples=1_000_000), 2)
    assert out.argv == ["--global-batch-size", "1536", "--train-samples", "3072", "--lr-decay-samples", "1000000"]


def test_k_at_or_beyond_the_jobs_length_changes_nothing() -> None:
    assert shorten(JOB, _ns(train_iters=500000), 500000).note is None
    assert shorten(["--train-samples", "100"], _ns(train_samples=100), 1).note is None
    assert shorten([], _ns(), 5).argv == []


def test_an_evaluation_beyond_the_first_k_iterations_is_left_out() -> None:
    """Megatron evaluates at the end of training; the job at iteration K would not when K < --eval-interval."""
    argv = [*JOB, "--eval-iters", "10", "--eval-interval", "1000"]
    out = shorten(argv, _ns(train_iters=500000, eval_iters=10, eval_interval=1000), 2)
    assert out.argv[-2:] == ["--eval-iters", "0"] and "--eval-iters 0" in str(out.note)
    kept = shorten(argv, _ns(train_iters=500000, eval_iters=10, eval_interval=1000), 1000)
    assert "--eval-iters" in kept.argv and kept.argv[kept.argv.index("--eval-iters") + 1] == "10"
