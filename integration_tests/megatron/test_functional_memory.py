"""Peak allocated memory of Megatron-LM's H100 functional tests, predicted on a virtual H100.

Three cases of ``validation/megatron_functional/cases`` (NVIDIA's golden values, branch core_r0.19.0, measured on a
DGX H100) run with their own arguments, mock data and ``--train-iters 3``
(`validation.megatron_functional.run.run_case`: through the drop-in as their last rank, rank 7 of 8, or with a
pipeline through ``prism emulate``, the last stage's profiling run giving the memory): TransformerEngine's layers
(TE spec), TP1/PP1 with the distributed optimizer, TP1/PP4, and TP2/PP2, and the two cases with CUDA graphs (TE's
``make_graphed_callables``: `prism_plugin.device.graphs`). Each runs in one to two minutes on a 2-core host.

What is asserted, per case:

- the golden ``mem-max-allocated-bytes`` at step 3 against prism's allocator-model peak, which holds torch's two
  cuBLAS workspaces as a GPU's allocator does (forward and autograd threads; 32 MiB each under the cases'
  ``CUBLAS_WORKSPACE_CONFIG=:4096:8``: ``setWorkspaceForHandle`` in CublasHandlePool.cpp allocates them through
  the caching allocator at a handle's first GEMM on a stream). Errors measured when the workspaces were added
  to the allocator's peak by hand (e6b4834): -0.000% (tp1_pp1 dist-optimizer: 512 B apart), -0.003% (tp1_pp4),
  -0.165% (tp2_pp2); bound 0.5%, two-sided. Without the workspaces the allocator model was -2.49%, -3.04% and
  -4.87% off: 64 MiB, the whole gap;
- the workspaces themselves: two of exactly 32 MiB.

`test_every_case_that_runs_is_within_the_goal` (heavy: about 16 minutes) holds every other case that runs to
issue 18's goal, 1%; the cases that miss it today are strict expected failures with their measured errors.

The iteration time is not asserted here: these small runs are launch-bound, and the host time per launch is one
fitted figure (recipes/RESULTS.md has the errors, fit and validate rows apart).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from validation.megatron_functional.run import CaseStatus, load_cases, run_case

pytestmark = pytest.mark.slow

CASES = (
    "gpt3_mcore_te_tp1_pp1_resume_torch_dist_dist_optimizer",
    "gpt3_mcore_te_tp1_pp4_resume_torch_dist_persistent_disable_bias_linear",
    "gpt3_mcore_te_tp2_pp2_resume_torch_dist",
    "gpt3_mcore_te_tp2_pp2_resume_torch_dist_defer_embedding_wgrad_compute",
    "gpt3_mcore_te_tp2_pp2_ep4_etp1_resume_torch_dist_attn_cudagraph",  # CUDA graphs (TE's): +0.024%
    "gpt3_moe_mcore_te_tp4_ep2_etp2_pp2_scoped_cudagraph",  # graphed attn, mlp, router, preprocess: -0.38%
)
CI_CASE = CASES[3]
"""The case CI runs (the others are heavy): TP2 x PP2 with the output layer's weight gradients deferred to the
pipeline's drain (the wgrad GEMM in grad mode: +45% before the fake extension kernels ran with autograd off)."""
BOUND_PCT = 0.5
CUBLAS_WORKSPACES_BYTES = 2 * 8 * 4096 * 1024  # two workspaces of CUBLAS_WORKSPACE_CONFIG=:4096:8 (8 x 4096 KiB)


@pytest.mark.parametrize("case", [pytest.param(c, marks=() if c == CI_CASE else pytest.mark.heavy) for c in CASES])
def test_peak_allocated_matches_golden(case: str, tmp_path: Path) -> None:
    row = load_cases([case])[0]
    result = run_case(row, tmp_path, timeout_s=600)
    assert result.status is CaseStatus.OK, f"{case} did not run: {result.reason} (log: {tmp_path / (case + '.log')})"
    assert result.predicted_cublas_workspace_bytes == CUBLAS_WORKSPACES_BYTES
    error = result.memory_error_pct
    assert error is not None and abs(error) <= BOUND_PCT, (
        f"{case}: predicted {result.predicted_peak_allocated_bytes} B (cuBLAS workspaces "
        f"{result.predicted_cublas_workspace_bytes} B among them) vs golden {result.measured_peak_allocated_bytes} B: "
        f"{error:+.3f}% (bound {BOUND_PCT}%)")


GOAL_PCT = 1.0
"""Issue 18's goal: peak allocated within 1% on every case that runs."""
EVERY_OTHER_CASE = (
    "gpt3_mcore_te_tp1_pp1_dist_optimizer_fim_dataset",
    "gpt3_mcore_te_tp1_pp1_dist_optimizer_no_mmap_bin_files",
    "gpt3_mcore_te_tp1_pp1_resume_torch_dist_uniform_full_recompute",
    "gpt3_mcore_te_tp1_pp2_resume_torch_dist_rope_embeddings",
    "gpt3_mcore_te_tp1_pp2_resume_torch_dist_rope_embeddings_interleaved_no_fusion",
    "gpt3_mcore_te_tp1_pp4_resume_torch_dist_disable_bias_linear",
    "gpt3_mcore_te_tp1_pp4_resume_torch_dist_swiglu",
    "gpt3_mcore_te_tp1_pp4_resume_torch_dist_untie_embeddings_and_outputs",
    "gpt3_mcore_te_tp1_pp4_vp1",
    "gpt3_mcore_te_tp1_pp4_vp1_resume_torch_decoupled_lr",
    "gpt3_mcore_te_tp1_pp4_vp1_dist_optimizer_overlap_grad_reduce_param_gather_overlap_optimizer",
    "gpt3_mcore_te_tp1_pp4_vp1_resume_torch_dist_calculate_per_token_loss",
    "gpt3_mcore_te_tp1_pp4_vp1_resume_torch_dist_dist_optimizer_overlap_grad_reduce",
    "gpt3_mcore_te_tp1_pp4_vp1_resume_torch_dist_dist_optimizer_overlap_grad_reduce_param_gather",
    "gpt3_mcore_te_tp1_pp4_vp1_resume_torch_dist_dist_optimizer_overlap_grad_reduce_untied",
    "gpt3_mcore_te_tp1_pp4_vp1_resume_torch_dist_tunable_overlap",
    "gpt3_mcore_te_tp1_pp4_vp1_tunable_overlap",
    "gpt3_mcore_te_tp1_pp4_vp1_uneven_pipeline",
    "gpt3_mcore_te_tp1_pp4_vp2_account_for_embedding_loss_in_pipeline_split",
    "gpt3_mcore_te_tp2_pp2_cross_entropy_loss_fusion",
    "gpt3_mcore_te_tp2_pp2_mla",
    "gpt3_mcore_te_tp2_pp2_resume_torch_dist_cross_entropy_loss_fusion",
    "gpt3_mcore_te_tp2_pp2_resume_torch_dist_ddp_average_in_collective",
    "gpt3_mcore_te_tp2_pp2_resume_torch_dist_no_create_attention_mask_in_dataloader",
    "gpt3_mcore_te_tp2_pp2_resume_torch_dist_reshard_1x4xNone",
    "gpt3_mcore_te_tp4_pp1_dist_optimizer_overlap_grad_reduce_param_gather",
    "gpt3_mcore_te_tp4_pp1_resume_torch_dist_dist_optimizer_overlap_grad_reduce",
    "gpt3_mcore_te_tp4_pp1_resume_torch_dist_dist_optimizer_overlap_grad_reduce_param_gather",
    "gpt3_mcore_te_tp4_pp1_resume_torch_dist_qk_layernorm_test_mode",
    "gpt3_mcore_te_tp4_pp2_resume_torch_dist_reshard_8x1xNone",
    "gpt3_mcore_tp1_pp1_resume_torch_dist_dist_optimizer_overlap_grad_reduce_param_gather",
    "gpt3_mcore_tp1_pp2",
    "gpt3_mcore_tp1_pp4",
    "gpt3_mcore_tp4_pp1_resume_torch",
    "gpt3_mcore_tp4_pp1_resume_torch_dist",
    "gpt3_moe_mcore_te_tp4_ep2_etp2_pp2_resume_torch_dist_dist_optimizer",
    "gpt3_mcore_te_tp2_pp1_te_8experts_etp1_ep4",  # the all-gather dispatcher, answered by the routing policy
    "gpt3_moe_mcore_te_ep8_resume_torch_dist_dist_optimizer",  # the same
    # the sinkhorn router (its convergence test answered: log_values.SINKHORN)
    "gpt3_mcore_te_tp1_pp2_resume_torch_dist_reshard_2x1x4_te_8experts2parallel_dist_optimizer",
    "gpt3_mcore_te_tp2_pp1_resume_torch_dist_te_8experts2parallel_dist_optimizer",
    "gpt3_mcore_te_tp2_pp1_resume_torch_dist_te_8experts2parallel_multi_dist_optimizer_instances",
    "gpt3_mcore_te_tp2_pp1_te_8experts2parallel_ddp_average_in_collective",
    "gpt3_mcore_te_tp2_pp1_te_8experts2parallel_overlap_grad_reduce_param_gather_groupedGEMM",
    "gpt3_mcore_tp2_pp2_ep2_etp2_te_4experts2parallel",
    "gpt3_mcore_tp2_pp2_ep2_etp2_te_4experts2parallel_dp_last",
    "gpt3_mcore_tp2_pp2_ep2_te_4experts2parallel",
    # TE's flash backend (flash-attn's Python layer over a fake extension), context parallelism's ring among them
    "gpt3_mcore_cp2_pp2_ep2_te_4experts2parallel_nondeterministic",
    "gpt3_mcore_cp2_pp2_ep2_te_4experts2parallel_nondeterministic_dp_last",
    "gpt3_mcore_te_tp2_pp1_resume_torch_dist_cp2_nondeterministic",
    "gpt3_mcore_te_tp2_pp2_cp2",
    "gpt3_mcore_te_tp2_pp2_cp2_calculate_per_token_loss",
    "gpt3_mcore_te_tp2_pp2_cp2_calculate_per_token_loss_nondeterministic",
    "gpt3_mcore_te_tp2_pp2_cp2_etp4_calculate_per_token_loss_dp_last",
    "gpt3_mcore_te_tp2_pp2_cp2_etp4_calculate_per_token_loss_nondeterministic_dp_last",
    "gpt3_mcore_te_tp2_pp2_cp2_etp4_dp_last",
    "gpt3_mcore_te_tp2_pp2_cp2_etp4_nondeterministic_dp_last",
    "gpt3_mcore_te_tp2_pp2_cp2_nondeterministic",
    "gpt3_mcore_te_tp2_pp2_resume_torch_dist_cp2_nondeterministic",
    "gpt3_mcore_tp2_cp2_pp2_ep2_te_4experts2parallel",
    "gpt3_mcore_tp2_cp2_pp2_ep2_te_4experts2parallel_dp_last",
    "gpt3_mcore_te_tp2_pp1_resume_torch_dist_multi_dist_optimizer_instances",
    "gpt3_mcore_te_tp2_pp1_te_a2a_ovlp_8experts_etp1_ep4",
    "gpt3_moe_mcore_te_tp2_pp2_ep4_etp1_no_mtp_no_a2a_ovlp_fine_grained_offloading",
    "gpt3_mcore_te_tp1_pp1_te_4experts_groupedGEMM_op_fuser",  # -0.03% since TE's grouped-MLP imports run
    # Megatron-FSDP's uneven shards (the peers' shapes from the buffer layout: adapters/megatron/fsdp_chunks.py)
    "gpt3_mcore_te_tp2_zp_z3_resume_fsdp_dtensor",
    "gpt3_mcore_te_tp2_zp_z3_resume_torch_dist_te_8experts2parallel_top2router",
    "deepseek_proxy_fsdp_ep2_fsdp2_ep_overlap",  # and NCCL's PREMUL_SUM (FSDP2's gradient reduce-scatter)
)
"""The other cases that run on a virtual H100 (38 of 78 at 50f9da057bc0, and since: the two weight-hash-check cases,
the two all-gather-dispatcher cases and the eight sinkhorn-router cases; at d38c4b8b5354 the 14 flash-backend
cases, multi_dist_optimizer_instances, a2a_ovlp and the offloading case without MTP; the rest are refused up front
or stop in a path listed in recipes/RESULTS.md): about 25 s each on a 2-core host, so heavy."""
MISSED = {
    "gpt3_moe_mcore_te_tp4_ep2_etp2_pp2_resume_torch_dist_dist_optimizer":
        "-1.08% at 50f9da057bc0: not diagnosed",
    "gpt3_mcore_te_tp2_pp1_te_8experts_etp1_ep4":
        "+2.47% since the all-gather dispatcher runs: balanced routing (the policy) against the real run's routing; "
        "not diagnosed further",
    "gpt3_mcore_te_tp2_pp1_te_a2a_ovlp_8experts_etp1_ep4":
        "+4.63% since Megatron's combined 1F1B schedule (MoE all-to-all overlap) runs (session 13): not diagnosed",
    "gpt3_moe_mcore_te_tp2_pp2_ep4_etp1_no_mtp_no_a2a_ovlp_fine_grained_offloading":
        "+24.4% since the virtual GPU's activations are offloaded (2026-12-04; +112.4% before, when "
        "Megatron's offload handler refused fake tensors and offloaded nothing): not diagnosed further",
    "gpt3_mcore_te_tp2_zp_z3_resume_fsdp_dtensor": "+2.27% when Megatron-FSDP first ran (2026-12-04): not diagnosed",
    "gpt3_mcore_te_tp2_zp_z3_resume_torch_dist_te_8experts2parallel_top2router":
        "-1.94% when Megatron-FSDP first ran (2026-12-04): not diagnosed",
    "deepseek_proxy_fsdp_ep2_fsdp2_ep_overlap": "+3.30% when it first ran (2026-12-04): not diagnosed",
}
"""Cases where the goal is missed today, with the measured error; strict: one that comes within the goal fails here
until it is taken off this list."""


@pytest.mark.heavy
@pytest.mark.parametrize("case", [
    pytest.param(case, marks=pytest.mark.xfail(strict=True, reason=MISSED[case])) if case in MISSED else case
    for case in EVERY_OTHER_CASE])
def test_every_case_that_runs_is_within_the_goal(case: str, tmp_path: Path) -> None:
    result = run_case(load_cases([case])[0], tmp_path, timeout_s=600)
    assert result.status is CaseStatus.OK, f"{case} did not run: {result.reason}"
    error = result.memory_error_pct
    assert error is not None and abs(error) <= GOAL_PCT, (
        f"{case}: predicted {result.predicted_peak_allocated_bytes} B vs golden "
        f"{result.measured_peak_allocated_bytes} B: {error:+.3f}% (goal {GOAL_PCT}%)")


FSDP_CASE = "gpt3_mcore_te_tp2_zp_z3_resume_fsdp_dtensor"


def test_megatron_fsdp_uneven_shards_run_with_their_peers_shapes_from_the_buffer_layout(tmp_path: Path) -> None:
    """Megatron-FSDP (``--use-megatron-fsdp``, TP2, ZeRO-3-style sharding, 8 GPUs, rank 7): each parameter's rows fall
    unevenly over the data-parallel shards; the chunk offsets come from the peers' shapes, which the adapter answers
    from the buffer layout (before: "DTensor chunk metadata is invalid. Offsets: (3500, 0) ... Global shape: [2048,
    512]"), and Megatron-FSDP's TP RNG sync from a virtual TP rank 0 mirrors this rank's states. About 30 s."""
    import json

    result = run_case(load_cases([FSDP_CASE])[0], tmp_path, timeout_s=600)
    assert result.status is CaseStatus.OK, f"{FSDP_CASE} did not run: {result.reason}"
    summary = json.loads((tmp_path / FSDP_CASE / "rank7.summary.json").read_text())
    sites = {s["site"]: s["count"] for s in summary["virtual_gpu"]["values"]["by_site"]}
    assert sites["megatron_fsdp/uneven_dtensor.py:gather_and_compute_chunk_metadata"] > 0
    assert sites["megatron/core/distributed/fsdp/mcore_fsdp_adapter.py:sync_rng_states_across_tp_group"] >= 1
    assert result.memory_error_pct is not None and abs(result.memory_error_pct) <= 3.0  # +2.27% measured (MISSED)
