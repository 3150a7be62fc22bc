"""Fault specs in the user's words (issue 11, item 3 and the fault half of item 2).

- ``group=`` takes one vocabulary (`prism_plugin.config.faults.GROUP_ROLES`), checked at parse time, matched
  against the frameworks' own group names (Megatron's group_desc, DeepSpeed's grid names) exactly: ``tp``
  is TENSOR_MODEL_PARALLEL_GROUP, not TENSOR_AND_DATA_PARALLEL_GROUP (tier a and b);
- when a hang fires is one clock on every real rank, so two real ranks report the same step (tier b: the
  two real ranks of one job played one after the other in this process);
- a hang or crash that never fired says so at exit; ``strict=true`` fails.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import prism_plugin as P
from prism_plugin.config.emulation import ConfigError, EmulationConfig, VirtualWorld
from prism_plugin.config.faults import GROUP_ROLES, desc_role, graph_role_matches, group_role, parse_fault
from prism_plugin.runtime.live_faults import FaultNeverFiredError


# -- the vocabulary (tier a) ----------------------------------------------------------------------------
@pytest.mark.parametrize(("word", "name"), [
    ("tp", "tp"), ("tensor", "tp"), ("TENSOR_MODEL_PARALLEL_GROUP", "tp"), ("slice", "tp"),
    ("pp", "pp"), ("pipe", "pp"), ("PIPELINE_MODEL_PARALLEL_GROUP", "pp"),
    ("dp", "dp"), ("data", "dp"), ("DATA_PARALLEL_GROUP", "dp"), ("DATA_PARALLEL_GROUP_GLOO", "dp"),
    ("cp", "cp"), ("CONTEXT_PARALLEL_GROUP", "cp"), ("ep", "ep"), ("EXPERT_MODEL_PARALLEL_GROUP", "ep"),
    ("dp_cp", "dp_cp"), ("dp-cp", "dp_cp"), ("cp-dp", "dp_cp"), ("DATA_PARALLEL_GROUP_WITH_CP", "dp_cp"),
    ("model", "mp"), ("MODEL_PARALLEL_GROUP", "mp"), ("tp-dp", "tp_dp"), ("world", "world"),
])
def test_group_words_name_one_vocabulary(word: str, name: str) -> None:
    assert group_role(word) == name
    assert parse_fault(f"hang:rank=1,group={word},op=3").group == name


def test_unknown_group_is_refused_at_parse_time_listing_the_names() -> None:
    with pytest.raises(ConfigError, match=r"hang: group='tpp' is not a group name; use one of \['tp', 'pp', 'dp'"):
        parse_fault("hang:rank=1,group=tpp,op=3")
    with pytest.raises(ConfigError, match="group="):
        EmulationConfig(world=VirtualWorld(world_size=4, real_ranks=(0,)), faults=("hang:rank=1,group=tpp",))


def test_framework_names_match_exactly_not_by_substring() -> None:
    assert desc_role("TENSOR_MODEL_PARALLEL_GROUP") == "tp"
    assert desc_role("TENSOR_AND_DATA_PARALLEL_GROUP") == "tp_dp"  # "tensor" is in it, but it is not tp
    assert desc_role("EXPERT_TENSOR_PARALLEL_GROUP") == "etp"
    assert desc_role("tp0") == desc_role("tp-1") == "tp"  # a plain script's indexed descs
    assert desc_role("HIERARCHICAL_DATA_PARALLEL_GROUP_L0") is None and desc_role("undefined") is None
    assert graph_role_matches("dp_cp", "cp-dp") and not graph_role_matches("tp", "tp-dp")
    megatron = {d for r in GROUP_ROLES.values() for d in r.megatron}
    assert {"TENSOR_MODEL_PARALLEL_GROUP", "PIPELINE_MODEL_PARALLEL_GROUP", "DATA_PARALLEL_GROUP",
            "CONTEXT_PARALLEL_GROUP", "EXPERT_MODEL_PARALLEL_GROUP", "DATA_PARALLEL_GROUP_WITH_CP"} <= megatron
    assert {d for r in GROUP_ROLES.values() for d in r.deepspeed} == {"pipe", "data", "model", "slice"}


def test_strict_is_a_field_of_hang_and_crash() -> None:
    assert parse_fault("hang:rank=1,group=tp,op=3,strict=true").strict
    assert parse_fault("crash:rank=1,step=2,strict=1").to_text() == "crash:rank=1,step=2,strict=true"
    with pytest.raises(ConfigError, match="strict='maybe' must be true or false"):
        parse_fault("crash:rank=1,strict=maybe")


# -- live matching (tier b) -------------------------------------------------------------------------------
@pytest.fixture
def emulate():
    def start(world_size: int, rank: int, **kwargs) -> P.Session:
        return P.activate(EmulationConfig(world=VirtualWorld(world_size=world_size, real_ranks=(rank,)),
                                          iteration_marker="explicit", **kwargs))

    yield start
    P.deactivate()


def test_megatron_descs_match_the_users_word(emulate) -> None:
    emulate(4, 0, timeout_s=0.2, faults=("hang:rank=1,group=tp,op=2",))
    tdp = dist.new_group([0, 1, 2, 3], group_desc="TENSOR_AND_DATA_PARALLEL_GROUP")
    tp = dist.new_group([0, 1], group_desc="TENSOR_MODEL_PARALLEL_GROUP")
    t = torch.ones(4)
    dist.all_reduce(t, group=tdp)  # holds rank 1, but not a tp group: not counted
    dist.all_reduce(t, group=tdp)
    dist.all_reduce(t, group=tp)
    with pytest.raises(RuntimeError, match="Timed out waiting 200ms"):
        dist.all_reduce(t, group=tp)  # the 2nd tp op
    summary = P.deactivate()
    (event,) = summary["faults"]["events"]
    assert (event["group_desc"], event["seq"]) == ("TENSOR_MODEL_PARALLEL_GROUP", 2)
    assert summary["faults"]["never_fired"] == []


def test_a_desc_given_after_creation_counts(emulate) -> None:
    """The DeepSpeed adapter labels its grid's groups after DeepSpeed created them (``_set_group_desc``)."""
    emulate(4, 0, timeout_s=0.2, faults=("hang:rank=1,group=data,op=1",))
    g = dist.new_group([0, 1])
    g._set_group_desc("data")
    with pytest.raises(RuntimeError, match="Timed out"):
        dist.all_reduce(torch.ones(2), group=g)


def _two_step_program() -> list[int]:
    """World 8: tp groups [0,1], [2,3], ...; dp groups [0,2,4,6], [1,3,5,7]. Each step: 2 tp ops, 1 dp op.
    Returns the steps at which an op raised."""
    rank = dist.get_rank()
    tp = [dist.new_group([2 * i, 2 * i + 1], group_desc=f"tp{i}") for i in range(4)][rank // 2]
    dp = [dist.new_group(list(range(i, 8, 2)), group_desc=f"dp{i}") for i in range(2)][rank % 2]
    t = torch.ones(4)
    failed = []
    for step in range(1, 4):
        P.mark_iteration()
        for group in (tp, tp, dp):
            try:
                dist.all_reduce(t, group=group)
            except RuntimeError:
                failed.append(step)
                return failed
    return failed


def test_two_real_ranks_of_one_job_report_one_step(emulate) -> None:
    """``hang:rank=1,op=3``: rank 1 stops before its 3rd op (its dp op of step 1). Real rank 5 shares that dp
    group and fails there; real rank 0 shares only the tp group, so its next op with rank 1 (step 2) fails.
    Both report that rank 1 stopped in step 1 (before: rank 0 counted only the ops it shared with rank 1
    and said step 2, rank 5 said step 3)."""
    events = {}
    for rank in (0, 5):
        emulate(8, rank, timeout_s=0.1, faults=("hang:rank=1,op=3",))
        failed = _two_step_program()
        (events[rank],) = P.deactivate()["faults"]["events"]
        assert failed == [events[rank]["raised_at_step"]]
    assert events[0]["step"] == events[5]["step"] == 1
    assert (events[0]["raised_at_step"], events[5]["raised_at_step"]) == (2, 1)


def test_a_hang_on_a_group_that_never_occurs_says_never_fired(emulate, capfd) -> None:
    emulate(4, 0, faults=("hang:rank=1,group=pp,op=1", "crash:rank=3,step=9", "hang:rank=1,op=5,step=1"))
    t = torch.ones(2)
    P.mark_iteration()
    dist.all_reduce(t)
    summary = P.deactivate()
    err = capfd.readouterr().err
    assert "prism: fault hang:rank=1,op=1,group=pp,step=0: never fired on rank 0: no op of this rank ran on a " \
           "'pp' group" in err
    assert "crash:rank=3,step=9: never fired on rank 0: the run ended at step 1, before step 9" in err
    assert "hang:rank=1,op=5,step=1: never fired on rank 0: only 1 op(s) on any group from step 1" in err
    assert [f["fault"] for f in summary["faults"]["never_fired"]] == [
        "hang:rank=1,op=1,group=pp,step=0", "hang:rank=1,op=5,step=1", "crash:rank=3,step=9"]


def test_strict_fault_that_never_fired_fails_with_the_summary(emulate) -> None:
    emulate(4, 0, faults=("hang:rank=1,group=cp,strict=true",))
    dist.all_reduce(torch.ones(2))
    with pytest.raises(FaultNeverFiredError, match="never fired on rank 0") as info:
        P.deactivate()
    assert info.value.summary["faults"]["never_fired"][0]["strict"] is True
    assert info.value.summary["rank"] == 0
