"""The corpus of Megatron-LM's H100 functional-test cases (core_r0.19.0, the ``_memory_speed`` cases left out).

Every case of ``validation/megatron_functional/cases`` runs on virtual H100s with its own arguments and environment
and only the paths replaced (`run_case`: mock data, ``--train-iters 3``): through the drop-in as its last rank, or
with a pipeline through ``prism emulate`` (one profiling run per stage). The share that runs is printed, of every
case and of the cases the installed software can run on any device (`NOT_RUNNABLE_HERE`: a package the registries
lack, megatron-core 0.19.2's own argument check), and the latter is held to issue 20's 90%. Each case that does not
run must stop for the reason listed (`LIMITS`: the limits of fake execution), and a listed case that starts to run
fails here until it is taken off its list. About 55 minutes on a 2-core host: heavy.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from validation.megatron_functional.run import CaseStatus, load_cases, run_case

pytestmark = [pytest.mark.slow, pytest.mark.heavy]

GOAL_SHARE = 0.90
NOT_RUNNABLE_HERE = {
    "gpt3_weekly_mcore_tp2_pp2_current_scaling_native_fp8_tp_pp_sp_tp_overlap": "--deterministic-mode requires",
    "gpt3_moe_mcore_te_tp2_pp2_ep4_etp1_fine_grained_offloading": "Chunk mismatch",
}
"""Cases the installed software cannot run on any device, GPUs included, each with a fragment of the reason it
stops for:

- megatron-core 0.19.2's own argument check refuses the weekly case's --deterministic-mode with --tp-comm-overlap
  (the golden values came from the core_r0.19.0 branch, which allowed it);
- multi-token prediction with fine-grained activation offloading stops in Megatron's offload handler at iteration 2
  (its assertion "Chunk mismatch"). NVIDIA's own H100 recipe at core_r0.19.0 lists this case only in the
  ``mr-broken`` scope (the row's ``source.ci_scope``), and its golden values (2026-04-14) predate three changes to
  ``fine_grained_activation_offload.py`` on the branch (2026-05-22, 06-17, 07-02). Traced with the module's DEBUG
  on: in iteration 2 the MTP chunk of micro-batch 0 offloads none of its groups (each is the last of its name
  before that chunk's backward, ``should_bulk_offload``), so after its attention groups commit
  ``finish_all_groups`` says it is done (the "TODO: check if this is correct" there) and its MoE groups go to the
  next micro-batch's chunk, whose backward then pops micro-batch 0's chunk: the handler's own bookkeeping, with no
  device value or timing in it.

Not limits of fake execution: left out of the share's denominator, and printed. (Megatron's Muon runs since
2026-12-04: emerging-optimizers from the virtual GPUs' package folder.)"""
LIMITS: dict[str, str] = {
    # (CUDA graphs run since 2026-12-04: --cuda-graph-impl transformer_engine, prism_plugin/device/graphs.py)
    # (Megatron-FSDP's uneven shards run since 2026-12-04: the peers' shapes come from the buffer layout; and
    # NCCL's PREMUL_SUM, FSDP2's gradient reduce-scatter)
}
"""Cases that do not run on virtual GPUs, each with a fragment of the reason it stops for."""


def test_at_least_ninety_percent_of_the_corpus_runs(tmp_path: Path) -> None:
    cases = load_cases(None)
    stopped: dict[str, str] = {}
    for row in cases:
        result = run_case(row, tmp_path, timeout_s=900)
        if result.status is not CaseStatus.OK:
            stopped[result.case] = result.reason or "no result"
    runnable = len(cases) - len(NOT_RUNNABLE_HERE)
    ran = len(cases) - len(stopped)
    print(f"{ran} of {len(cases)} cases run ({ran / len(cases):.1%}); {ran} of the {runnable} the installed software "
          f"can run on any device ({ran / runnable:.1%})")
    expected = {**NOT_RUNNABLE_HERE, **LIMITS}
    unexplained = {case: why for case, why in stopped.items()
                   if case not in expected or expected[case] not in why}
    assert not unexplained, f"cases that stopped for a reason not listed: {unexplained}"
    running = sorted(set(expected) - set(stopped))
    assert not running, f"listed as not running, but ran: {running} (take them off the lists)"
    assert ran / runnable >= GOAL_SHARE
