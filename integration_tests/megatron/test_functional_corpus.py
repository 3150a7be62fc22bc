"""The corpus of Megatron-LM's H100 functional-test cases (core_r0.19.0, the ``_memory_speed`` cases left out).

Every case of ``validation/megatron_functional/cases`` runs one job through the drop-in as its last rank on a
virtual H100, with its own arguments and environment and only the paths replaced (`run_case`: mock data,
``--train-iters 3``). The share that runs is printed and held to issue 20's 90%; each case that does not run must
stop for the reason listed in `LIMITS`, and a listed case that starts to run fails here until it is taken off the
list. About 40 minutes on a 2-core host: heavy.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from validation.megatron_functional.run import CaseStatus, load_cases, run_case

pytestmark = [pytest.mark.slow, pytest.mark.heavy]

GOAL_SHARE = 0.90
LIMITS = {
    "gpt3_mcore_te_tp2_pp2_ep4_etp1_resume_torch_dist_attn_cudagraph":
        "--cuda-graph-impl",  # CUDA graphs capture real kernels (refused before any process starts)
    "gpt3_moe_mcore_te_tp4_ep2_etp2_pp2_scoped_cudagraph":
        "--fp8-recipe blockwise",  # and CUDA graphs: both refused
    "gpt3_moe_mcore_te_ep8_resume_torch_dist_dist_muon":
        "emerging-optimizers",  # Megatron's Muon needs a package the registries do not hold
    "gpt3_moe_mcore_te_ep8_resume_torch_dist_muon": "emerging-optimizers",
    "gpt3_weekly_mcore_tp2_pp2_current_scaling_native_fp8_tp_pp_sp_tp_overlap":
        "--deterministic-mode requires",  # megatron-core 0.19.2 refuses the case's own combination
    "gpt3_mcore_te_tp2_zp_z3_resume_fsdp_dtensor":
        # Megatron-FSDP builds each DTensor's chunk metadata from values its virtual peers would hold
        "DTensor chunk metadata is invalid",
    "gpt3_mcore_te_tp2_zp_z3_resume_torch_dist_te_8experts2parallel_top2router": "DTensor chunk metadata is invalid",
    "deepseek_proxy_fsdp_ep2_fsdp2_ep_overlap": "DTensor chunk metadata is invalid",
    "gpt3_moe_mcore_te_tp2_pp2_ep4_etp1_fine_grained_offloading":
        "'<' not supported between instances of 'NoneType'",  # not diagnosed: the embedding's input is None
}
"""Cases that do not run, each with a fragment of the reason it stops for."""


def test_at_least_ninety_percent_of_the_corpus_runs(tmp_path: Path) -> None:
    cases = load_cases(None)
    stopped: dict[str, str] = {}
    for row in cases:
        result = run_case(row, tmp_path, timeout_s=900)
        if result.status is not CaseStatus.OK:
            stopped[result.case] = result.reason or "no result"
    share = 1 - len(stopped) / len(cases)
    print(f"{len(cases) - len(stopped)} of {len(cases)} cases run ({share:.1%})")
    unexplained = {case: why for case, why in stopped.items()
                   if case not in LIMITS or LIMITS[case] not in why}
    assert not unexplained, f"cases that stopped for a reason not listed in LIMITS: {unexplained}"
    running = sorted(set(LIMITS) - set(stopped))
    assert not running, f"listed as not running, but ran: {running} (take them off LIMITS)"
    assert share >= GOAL_SHARE
