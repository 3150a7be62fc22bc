"""Megatron's logging options on virtual GPUs: the value policy's stated answers, and what a missing writer does.

Megatron's functional tests always log ``--log-num-zeros-in-grad --log-params-norm``. Both read values the virtual
GPU does not have:

- ``--log-num-zeros-in-grad``: ``megatron/core/optimizer/clip_grads.py``'s ``count_zeros_fp32`` sums
  ``numel - count_nonzero(grad)`` over the gradients into an int64 tensor, all-reduces it and reads it
  (``.item()``). The stated answer (`COUNT_ZEROS`): 0, no gradient element is exactly zero. Megatron only logs
  the count (``num zeros`` in its iteration line, TensorBoard's ``num-zeros``); nothing branches on it;
- ``--log-params-norm``: the parameters' l2 norm is a floating-point read, answered by the policy's finite
  ``float_value`` like the gradient norm.

Both are counted per call site in the summary's ``values`` (``stated`` lists the answer and its reason).

``--check-weight-hash-across-dp-replicas-interval N``: ``megatron/core/utils.py``'s
``check_param_hashes_across_dp_replicas`` hashes each parameter's bytes on the host (``.numpy()``) and compares the
hashes over the data-parallel group. A virtual GPU's parameters have no bytes; under the backend's data policy
every virtual replica mirrors this rank's values, so the stated answer (`WEIGHT_HASH`) is True, the replicas
match; counted in ``values.by_site`` like the other answers (`answer_weight_hash_check`).

``--moe-router-load-balancing-type sinkhorn``: ``megatron/core/transformer/moe/moe_utils.py``'s ``sinkhorn`` iterates
until ``error > tol`` reads False, a data-dependent count of iterations. The stated answer (`SINKHORN`): False, it
converges after its first iteration. Every iteration allocates and frees the same small tensors, so the peak is the
same whatever the count; the time of the iterations a real run adds (a few small kernels each) is not modelled.

Megatron-FSDP (``--use-megatron-fsdp``): ``megatron_fsdp/uneven_dtensor.py``'s ``validate_uneven_dtensor``
checks that a DTensor's shards tile it: each rank's two flags (its chunk starts at 0, ends at the size) are
MAX-reduced over the shard group and must all be set. This rank's own flags are known, its peers' are not; the
stated answer (`FSDP_BOUNDARIES`) is True, the check passes.

``--tensorboard-dir`` / ``--log-timers-to-tensorboard`` / ``--log-memory-to-tensorboard``: Megatron writes
TensorBoard events through ``torch.utils.tensorboard``, which needs the ``tensorboard`` package. Without it
Megatron warns and writes nothing; `tensorboard_note` says so in one line naming the fix
(``pip install tensorboard``), since Megatron's own warning blames the PyTorch version.

``--wandb-project``: Megatron's last rank imports ``wandb`` and calls ``wandb.init``. Without the package that is
an ImportError at start-up, so `wandb_mode` refuses the flag first, naming the fix; with it, a W&B server this
host cannot reach (``WANDB_BASE_URL``, default ``https://api.wandb.ai``, probed with one 2 s TCP connect) makes the
run offline (``WANDB_MODE=offline``: W&B writes the run under ``--wandb-save-dir`` for a later ``wandb sync``), said
in one line; a ``WANDB_MODE`` the launch set is left as it is.
"""

from __future__ import annotations

import importlib.util
import os
import socket
from typing import Any
from urllib.parse import urlsplit

from prism_plugin.config.errors import ConfigError
from prism_plugin.device.values import SiteAnswer, ValuePolicy

__all__ = ["COUNT_ZEROS", "FSDP_BOUNDARIES", "SINKHORN", "WEIGHT_HASH", "answer_weight_hash_check", "state_answers",
           "tensorboard_note", "wandb_mode"]

COUNT_ZEROS = SiteAnswer(
    path_suffix="megatron/core/optimizer/clip_grads.py", function="count_zeros_fp32", value=0,
    reason="--log-num-zeros-in-grad: no gradient element is exactly zero (Megatron logs the count; nothing "
           "branches on it)")
"""The stated answer of ``count_zeros_fp32``'s read."""

SINKHORN = SiteAnswer(
    path_suffix="megatron/core/transformer/moe/moe_utils.py", function="sinkhorn", value=False,
    reason="--moe-router-load-balancing-type sinkhorn: converged after one iteration (each iteration allocates and "
           "frees the same tensors: the peak does not depend on the count; the time of further iterations is not "
           "modelled)")
"""The stated answer of ``sinkhorn``'s convergence test."""

FSDP_BOUNDARIES = SiteAnswer(
    path_suffix="megatron_fsdp/uneven_dtensor.py", function="validate_uneven_dtensor", value=True,
    reason="Megatron-FSDP's chunk-boundary check passes: some shard starts at 0 and some ends at the tensor's size "
           "(the shards tile it); the check MAX-reduces each rank's flags over the shard group, whose other members "
           "are virtual")
"""The stated answer of Megatron-FSDP's DTensor boundary check (``torch.all(boundary_checks)``)."""


WEIGHT_HASH = ("megatron/core/utils.py:check_param_hashes_across_dp_replicas",
               "True (--check-weight-hash-across-dp-replicas-interval: every virtual replica mirrors this rank's "
               "parameters)")
"""The call site and stated answer of the weight-hash check, as ``values.by_site`` lists them."""


def state_answers(values: ValuePolicy) -> None:
    """State this module's answers on `values` (the virtual GPU's value policy)."""
    values.state(COUNT_ZEROS)
    values.state(SINKHORN)
    values.state(FSDP_BOUNDARIES)


def answer_weight_hash_check(values: ValuePolicy) -> None:
    """Make ``check_param_hashes_across_dp_replicas`` answer `WEIGHT_HASH` (counted on `values`) in this process:
    on ``megatron.core.utils`` (imported here, before the training loop imports the name) and on
    ``megatron.training.training`` if it already holds the name."""
    import sys

    import megatron.core.utils as utils

    def check_param_hashes_across_dp_replicas(model: Any, cross_check: bool = False) -> bool:
        values.answers[WEIGHT_HASH] += 1
        return True

    utils.check_param_hashes_across_dp_replicas = check_param_hashes_across_dp_replicas
    training = sys.modules.get("megatron.training.training")
    if training is not None and hasattr(training, "check_param_hashes_across_dp_replicas"):
        training.check_param_hashes_across_dp_replicas = check_param_hashes_across_dp_replicas


def tensorboard_note(args: Any) -> str | None:
    """The one line to say when the job asks for TensorBoard logs this host cannot write (None: nothing to say)."""
    wanted = getattr(args, "tensorboard_dir", None)
    if not wanted or importlib.util.find_spec("tensorboard") is not None:
        return None
    also = [flag for flag, dest in (("--log-timers-to-tensorboard", "log_timers_to_tensorboard"),
                                    ("--log-memory-to-tensorboard", "log_memory_to_tensorboard"),
                                    ("--log-validation-ppl-to-tensorboard", "log_validation_ppl_to_tensorboard"))
            if getattr(args, dest, False)]
    flags = " ".join(["--tensorboard-dir", *also])
    return (f"prism: {flags}: the tensorboard package is not installed on this host, so Megatron writes no "
            f"TensorBoard events to {wanted} (its warning follows); the job runs on; pip install tensorboard to "
            "write them")


def wandb_mode(args: Any, environ: Any = os.environ) -> str | None:
    """Check ``--wandb-project`` before anything runs; set ``WANDB_MODE=offline`` in `environ` when the W&B server
    is unreachable from this host. Returns the line to say (None: nothing to say)."""
    project = getattr(args, "wandb_project", None)
    if not project:
        return None
    if importlib.util.find_spec("wandb") is None:
        raise ConfigError(f"--wandb-project {project}: the wandb package is not installed on this host (Megatron's "
                          "last rank imports it at start-up); pip install wandb, or leave out --wandb-project")
    if environ.get("WANDB_MODE"):
        return None
    url = environ.get("WANDB_BASE_URL") or "https://api.wandb.ai"
    parts = urlsplit(url)
    try:
        with socket.create_connection((parts.hostname or "", parts.port or (80 if parts.scheme == "http" else 443)),
                                      timeout=2.0):
            return None
    except OSError:
        environ["WANDB_MODE"] = "offline"
    return (f"prism: --wandb-project {project}: no W&B server reachable at {url} from this host, so W&B runs "
            "offline (WANDB_MODE=offline; `wandb sync` uploads the run later)")
