"""The adapter's seams, each shown at the Megatron site it exists for.

- CPU shim: for each numbered patch, a probe of the Megatron code path it fixes fails with every
  other patch installed but that one, and passes with the full shim; uninstall restores torch.
- Rank N-1 logs: with rank N-1 virtual the lowest real rank is Megatron's last rank for logging
  (``is_last_rank`` everywhere it was imported, ``print_rank_last``, ``Timers.log``); with N-1
  real nothing changes.
- TP data: a real TP rank 1 whose TP rank 0 is virtual gets a valid batch from Megatron's own
  ``get_batch_on_this_tp_rank``; with TP rank 0 real it gets rank 0's batch (no synthetic fill).
- Refusals, on argv parsed by Megatron's own parser.
- Triton: with triton hidden, megatron.core imports against the scoped stub (fresh process).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import programs_adapter as pa
import programs_megatron as pm
import pytest
import torch
from harness import Mode, Setup

pytestmark = pytest.mark.slow

ONE = Setup(mode=Mode.PRISM, world_size=4, real_ranks=(0,), label="adapter")

# the failure each patch fixes, as the probe reports it without that patch
EXPECTED = {
    1: "CUDA", 2: "CUDA", 3: "accelerator", 4: "CUDA", 5: "Wrapped parameters must be one of",
    6: "CUDA", 7: "Megatron requires CUDA", 8: "CUDA", 10: "sequence parallel not supported by torch LayerNorm",
}


@pytest.mark.parametrize("number", sorted(pa.PROBES))
def test_each_cpu_patch_fixes_its_failure(mcluster, number: int) -> None:
    cases = [(pa.shim_probe, {"number": number, "skip": False})]
    if number in EXPECTED:  # patch 9 removes a cost (an inductor compile), not an error: no ablation
        cases.append((pa.shim_probe, {"number": number, "skip": True}))
    results = [r[0] for r in mcluster.run_batch(ONE, cases)]
    assert results[0] is None, f"patch {number}: probe fails with the full shim: {results[0]}"
    if number in EXPECTED:
        assert results[1] is not None and EXPECTED[number] in results[1], \
            f"patch {number}: without it the probe gave {results[1]!r}"


def test_shim_uninstall_restores_torch(mcluster) -> None:
    result = mcluster.run(ONE, pa.shim_restores)[0]
    assert result["inside"] == {"is_available": True, "device": "cpu", "type": "torch.cuda.FloatTensor",
                                "applied": list(range(1, 11))}
    assert result["restored"] and result["modes_left"] == 0 and result["available_after"] is False


def test_last_rank_logs_move_to_the_lowest_real_rank(mcluster) -> None:
    result = mcluster.run(Setup(mode=Mode.PRISM, world_size=16, real_ranks=(5,), label="logs"), pa.log_case)[5]
    assert result["log_rank"] == 5 and result["is_last_rank"] and result["training_is_last_rank"]
    assert result["timer_logged_here"] and result["restored"]
    out = result["stdout"]
    assert "rank 15 (the last rank, where Megatron logs) is virtual" in out
    assert "LAST-RANK-LINE" in out and "RANK-0-LINE" in out


def test_real_last_rank_keeps_its_logs(mcluster) -> None:
    setup = Setup(mode=Mode.PRISM, world_size=16, real_ranks=(15,), label="logs")
    result = mcluster.run(setup, pa.log_case)[15]
    assert result["log_rank"] is None and result["is_last_rank"] and "is virtual" not in result["stdout"].split(
        "rank 0 is virtual")[-1]
    assert "LAST-RANK-LINE" in result["stdout"]


def test_tp_rank_with_virtual_source_gets_a_valid_batch(mcluster) -> None:
    got = mcluster.run(Setup(mode=Mode.PRISM, world_size=4, real_ranks=(1,), label="tp"), pa.tp_batch_case)[1]
    assert got["tokens"].min() >= 0 and got["tokens"].max() < pm.SEQ  # ids below any vocab >= seq length
    assert got["loss_mask"].eq(1).all() and got["position_ids"][0].tolist() == list(range(pm.SEQ))
    assert torch.equal(got["attention_mask"][0, 0], torch.ones(pm.SEQ, pm.SEQ, dtype=torch.bool).triu(1))


def test_tp_rank_with_real_source_gets_its_batch(mcluster) -> None:
    got = mcluster.run(Setup(mode=Mode.PRISM, world_size=4, real_ranks=(0, 1), label="tp"), pa.tp_batch_case)
    for key in ("tokens", "labels", "position_ids", "attention_mask"):
        assert torch.equal(got[0][key], got[1][key]), key
    assert torch.equal(got[1]["tokens"], pm._batch(0, 0, 0)[0])


@pytest.mark.parametrize("argv,cpu_mode,fragment", [
    (["--tp-comm-overlap", "--transformer-impl", "local"], False, "--tp-comm-overlap"),
    (["--moe-token-dispatcher-type=flex", "--transformer-impl", "local"], False, "DeepEP"),
    (["--use-nccl-ub", "--transformer-impl", "local"], False, "--use-nccl-ub"),
    (["--pipeline-model-parallel-comm-backend", "ucc", "--transformer-impl", "local"], False, "ucc"),
    ([], True, "--transformer-impl local"),
    (["--transformer-impl", "local", "--moe-token-dispatcher-type", "alltoall"], True, None),
])
def test_refusals_on_megatrons_parsed_args(mcluster, argv: list[str], cpu_mode: bool, fragment: str | None) -> None:
    message = mcluster.run(ONE, pa.refusal_case, argv=argv, cpu_mode=cpu_mode)[0]
    if fragment is None:
        assert message is None
    else:
        assert message is not None and fragment in message


def test_megatron_core_imports_against_the_triton_stub_when_triton_is_absent() -> None:
    script = textwrap.dedent("""
        import importlib.abc, sys
        class NoTriton(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name == "triton" or name.startswith("triton."):
                    raise ModuleNotFoundError(f"No module named {name!r}")
        sys.meta_path.insert(0, NoTriton())
        from prism_plugin.adapters.megatron import compat
        assert not compat.triton_is_real()
        assert compat.import_megatron_core() is True
        assert "triton" not in sys.modules
        from megatron.core.transformer.moe.ops import paged_stash
        try:
            paged_stash.paged_stash_copy_kernel[(1,)]()
        except NotImplementedError as exc:
            assert "triton is not installed" in str(exc)
            print("STUB-OK")
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180)
    assert "STUB-OK" in proc.stdout, proc.stderr[-2000:]
