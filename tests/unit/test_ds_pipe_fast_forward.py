"""The steady steps of DeepSpeed's TrainSchedule, as the pipeline engine's fast-forward finds them
(`prism_plugin.adapters.deepspeed.fast_forward._steady`): no process, no device."""

from __future__ import annotations

import pytest

from prism_plugin.adapters.deepspeed.fast_forward import _shape, _signature, _steady


@pytest.mark.parametrize(("micro_batches", "stages", "stage_id", "buffers", "steady"), [
    (16, 2, 0, 2, (6, 32)),  # 2 (16 + 2 - 1) = 34 steps; the first 2B steps have no step 2B before them
    (16, 2, 1, 2, (6, 33)),
    (32, 4, 0, 4, (14, 64)),  # 70 steps, 4 buffers
])
def test_the_steady_steps_repeat_those_a_turn_of_the_buffers_before(micro_batches: int, stages: int, stage_id: int,
                                                                    buffers: int, steady: tuple[int, int]) -> None:
    from deepspeed.runtime.pipe.schedule import TrainSchedule

    schedule = TrainSchedule(micro_batches=micro_batches, stages=stages, stage_id=stage_id)
    steps = list(schedule)
    assert len(steps) == 2 * (micro_batches + stages - 1) and schedule.num_pipe_buffers() == buffers
    start, stop = _steady(steps, buffers)
    assert (start, stop) == steady
    for i in range(start, stop):  # each a turn of the buffers after its like, and of the kinds 2 steps before
        assert _signature(steps[i]) == _signature(steps[i - 2 * buffers]) and _shape(steps[i]) == _shape(steps[i - 2])
    # the step after the run breaks it (the warm-down or the optimizer step), and every steady pair is one
    # forward and one backward
    assert stop == len(steps) or _signature(steps[stop]) != _signature(steps[stop - 2 * buffers]) \
        or _shape(steps[stop]) != _shape(steps[stop - 2])
    kinds = [{"ForwardPass", "BackwardPass"} & set(_shape(steps[i])) for i in range(start, stop)]
    assert all(len(k) == 1 for k in kinds) and kinds[0] != kinds[1]
