"""Megatron's CUDA graphs (``--cuda-graph-impl transformer_engine``) on a virtual H100 (issue 20, item 5).

A 2-layer TE GPT trains 3 iterations as rank 1 of 2 (DP2, 2 micro-batches per iteration) through the drop-in,
eager and with its attention modules graphed (``--cuda-graph-modules attn --cuda-graph-warmup-steps 0``, as
Megatron-LM's functional cases run it), the two runs started together; every figure checked is modelled (the
allocator model, virtual time, counts), so exact.

Megatron's ``TECudaGraphHelper`` captures with TransformerEngine's ``make_graphed_callables`` at the first
iteration; a virtual GPU answers ``torch.cuda.CUDAGraph`` (`prism_plugin.device.graphs`): each capture recorded
once, each replay one launch of the captured kernels' summed time, the captures' memory from a private pool, TE's
weak references to static outputs owning no memory. Megatron-LM's own graphed cases (validation rows) come out
within 0.03% and 0.4% of their golden peak allocated bytes (`integration_tests/megatron/test_functional_memory.py`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from integration_tests.at_once import at_once
from integration_tests.megatron.drop_in import train

pytestmark = pytest.mark.slow

ITERATIONS, LAYERS, MICROBATCHES = 3, 2, 2
ARGS = ["--transformer-impl", "transformer_engine", "--num-layers", str(LAYERS), "--hidden-size", "256",
        "--num-attention-heads", "4", "--seq-length", "256", "--max-position-embeddings", "256",
        "--micro-batch-size", "2", "--global-batch-size", str(2 * 2 * MICROBATCHES), "--lr", "1e-4", "--mock-data",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "1024", "--bf16", "--log-interval", "1",
        "--eval-iters", "0", "--eval-interval", "1000", "--train-iters", str(ITERATIONS), "--disable-bias-linear"]
GRAPHS = ["--cuda-graph-impl", "transformer_engine", "--cuda-graph-modules", "attn", "--cuda-graph-warmup-steps",
          "0", "--te-rng-tracker"]


def _train(tmp: Path, name: str, extra: list[str]) -> dict[str, Any]:
    summary: dict[str, Any] = train(tmp / name, [*ARGS, *extra], iterations=ITERATIONS)["virtual_gpu"]
    return summary


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("cuda_graphs")
    eager, graphed = at_once(lambda: _train(tmp, "eager", []), lambda: _train(tmp, "graphed", GRAPHS))
    return {"eager": eager, "graphed": graphed}


def test_the_attention_graphs_are_captured_once_and_replayed_every_micro_batch(runs: dict) -> None:
    graphs = runs["graphed"]["cuda_graphs"]
    # TE captures a forward and a backward graph per graphed layer; each micro-batch replays both for each layer
    assert graphs["captured"] == 2 * LAYERS
    assert graphs["replays"] == ITERATIONS * MICROBATCHES * LAYERS * 2
    assert "cuda_graphs" not in runs["eager"]


def test_graphed_attention_is_one_launch_so_the_launch_bound_step_is_shorter(runs: dict) -> None:
    steps = {name: run["virtual_time"]["step_times_s"] for name, run in runs.items()}
    # modelled; host-bound (85 us a launch): 363 and 323 launches eager, 314 and 275 graphed
    assert steps == {"eager": [0.0312906, 0.0278426], "graphed": [0.0270668, 0.023705]}


def test_a_graph_s_intermediates_live_in_its_pool_not_in_the_allocated_bytes(runs: dict) -> None:
    eager, graphed = (runs[name]["devices"][0] for name in ("eager", "graphed"))
    assert (eager["peak_allocated_bytes"], graphed["peak_allocated_bytes"]) == (149_413_888, 147_030_016)
