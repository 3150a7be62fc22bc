"""Megatron-LM's example scripts (gpt3 175B, llama3 8B FP8, mixtral) through the drop-in with the prism flags added.

Each runs its first iteration (``--prism-iterations 1``) on a virtual H100 as the rank `validation.megatron_examples`
names, with its own arguments and its absent paths (`Example.added` lists the one argument each needed besides
the prism flags, and why). Asserted: Megatron logs iteration 1, the run ends cleanly, and the rank's summary holds
a modelled peak. Minutes each on a 2-core host: heavy.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from validation.megatron_examples import EXAMPLES, run

pytestmark = [pytest.mark.slow, pytest.mark.heavy]


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_the_example_logs_its_first_iteration(name: str, tmp_path: Path) -> None:
    result = run(EXAMPLES[name], tmp_path, iterations=1, timeout_s=1500)
    assert result.first_iteration_s is not None, f"{name}: no iteration logged:\n{result.log_tail}"
    assert result.exit_code == 0, f"{name}: exit {result.exit_code}:\n{result.log_tail}"
    assert (result.peak_allocated_bytes or 0) > 0
