"""``NCCL_ALGO`` / ``NCCL_NVLS_ENABLE`` honoured by the cost model (`prism_plugin.config.nccl`,
`prism_plugin.cost.model.allowed_algorithms`): the variables' syntax, which model algorithm each collective may
then use, the times that follow, and the refusal, before any process, of a setting that leaves a collective none."""

from __future__ import annotations

import doctest
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from prism_plugin.config import nccl as nccl_module
from prism_plugin.config.errors import ConfigError
from prism_plugin.config.kinds import Algorithm, OpKind
from prism_plugin.config.nccl import ALGORITHMS, nccl_from_environ, parse_nccl_algo
from prism_plugin.cost import CostModel, load_profile
from prism_plugin.cost import model as cost_model
from prism_plugin.cost.model import allowed_algorithms
from prism_plugin.launch.preflight import check_environment

PROFILE = load_profile("dgx-h100")
ACROSS = list(range(0, 1024, 8))  # 128 ranks, one per node: every collective crosses nodes
NODE = list(range(8))
R, T, H = Algorithm.RING, Algorithm.TREE, Algorithm.HIERARCHICAL


def test_doctests() -> None:
    for module in (nccl_module, cost_model):
        assert doctest.testmod(module).failed == 0, module.__name__


@pytest.mark.parametrize(("text", "nvls", "kind", "names"), [
    (None, None, "all_reduce", set(ALGORITHMS)),
    ("Ring", None, "all_gather", {"ring"}),
    ("ring,TREE", None, "all_reduce", {"ring", "tree"}),
    ("^nvls,nvlstree", None, "all_reduce", {"ring", "tree", "collnetdirect", "collnetchain", "pat"}),
    ("allreduce:tree;allgather:ring", None, "all_reduce", {"tree"}),
    ("allreduce:tree;allgather:ring", None, "reduce_scatter", set(ALGORITHMS)),  # not named: NCCL's free choice
    ("allreduce:tree;ring", None, "broadcast", {"ring"}),  # a bare list covers the collectives not named
    (None, "0", "all_reduce", set(ALGORITHMS) - {"nvls", "nvlstree"}),
    ("nvls,ring", "0", "all_gather", {"ring"}),
    (None, "1", "all_reduce", set(ALGORITHMS)),
])
def test_the_variables_syntax(text: str | None, nvls: str | None, kind: str, names: set[str]) -> None:
    assert parse_nccl_algo(text, nvls).allowed(kind) == names


@pytest.mark.parametrize(("text", "nvls", "message"), [
    ("Rng", None, "'rng' is not an NCCL algorithm"),
    ("allreduce:", None, "an empty list of algorithms"),
    ("alltoall:ring", None, "'alltoall' is not a collective NCCL_ALGO takes"),
    ("^", None, "an empty list"),
    (None, "yes", "NCCL_NVLS_ENABLE='yes': give 0 (off) or 1 (on)"),
])
def test_a_malformed_variable_names_itself_and_the_fix(text: str | None, nvls: str | None, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_nccl_algo(text, nvls)


@pytest.mark.parametrize(("text", "kind", "expected"), [
    (None, OpKind.ALL_REDUCE, (R, T, H)),
    (None, OpKind.ALL_GATHER, (R, H)),
    ("ring", OpKind.ALL_REDUCE, (R,)),
    ("tree,nvls", OpKind.ALL_REDUCE, (T, H)),
    ("allreduce:tree", OpKind.BARRIER, (T,)),  # NCCL runs a barrier as an all_reduce
    ("ring", OpKind.ALL_TO_ALL, ()),  # point to point and all_to_all: NCCL_ALGO does not govern them
])
def test_which_model_algorithms_a_collective_may_use(text: str | None, kind: OpKind,
                                                     expected: tuple[Algorithm, ...]) -> None:
    assert allowed_algorithms(kind, parse_nccl_algo(text)) == expected


def test_the_chosen_algorithm_and_time_follow_nccl_algo() -> None:
    free, ring = CostModel(PROFILE), CostModel(PROFILE, parse_nccl_algo("ring"))
    size = 1 << 20  # a small all_reduce over 128 nodes: the free choice is a tree (fewer latency terms)
    assert free.choose_algorithm(OpKind.ALL_REDUCE, size, ACROSS) is T
    assert ring.choose_algorithm(OpKind.ALL_REDUCE, size, ACROSS) is R
    assert ring.collective_us(OpKind.ALL_REDUCE, size, ACROSS) == free.collective_us(
        OpKind.ALL_REDUCE, size, ACROSS, algorithm=R) > free.collective_us(OpKind.ALL_REDUCE, size, ACROSS)
    tree = CostModel(PROFILE, parse_nccl_algo("allreduce:tree"))  # inside one node too
    assert tree.choose_algorithm(OpKind.ALL_REDUCE, size, NODE) is T
    assert tree.collective_us(OpKind.ALL_REDUCE, size, NODE) == free.collective_us(OpKind.ALL_REDUCE, size, NODE,
                                                                                    algorithm=T)
    assert tree.choose_algorithm(OpKind.ALL_GATHER, size, NODE) is R  # all_gather is not restricted


def test_a_setting_that_leaves_a_collective_no_algorithm_is_refused() -> None:
    with pytest.raises(ConfigError, match="NCCL_ALGO=tree: leaves all_gather no algorithm NCCL runs it with"):
        CostModel(PROFILE, parse_nccl_algo("tree"))
    with pytest.raises(ConfigError, match="NCCL_ALGO=tree"):
        check_environment([0], {"NCCL_ALGO": "tree"})
    check_environment([0], {"NCCL_ALGO": "Tree,Ring", "NCCL_NVLS_ENABLE": "0"})
    assert nccl_from_environ({"NCCL_ALGO": "ring"}).allowed("all_reduce") == {"ring"}


def test_prism_run_refuses_it_before_any_process(tmp_path: Path) -> None:
    script = tmp_path / "never.py"
    script.write_text("raise SystemExit('started')\n")
    proc = subprocess.run([sys.executable, "-m", "prism_plugin.cli.main", "run", "--world-size", "2",
                           "--real-ranks", "0", "--", str(script)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "NCCL_ALGO": "Rng"})
    assert proc.returncode == 2 and "NCCL_ALGO='Rng': 'rng' is not an NCCL algorithm" in proc.stderr
    assert "started" not in proc.stderr + proc.stdout
