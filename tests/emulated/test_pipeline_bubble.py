"""The interleaved 1F1B pipeline bubble, exact, in virtual time: Megatron-core's own schedule, traced and replayed.

Each stage s of a p-stage pipeline runs in a fresh process as the one real rank of p on a virtual GPU (virtual
time, a fixed kernel model) and calls Megatron-core's ``forward_backward_pipelining_with_interleaving`` (through
``get_forward_backward_func`` after ``initialize_model_parallel(1, p, v)``) on v model chunks and m micro-batches,
3 iterations, traced. The p traces become the execution graph (one class per stage, the first iteration dropped)
and its steady-state replay gives each stage's compute and bubble.

The model makes every chunk's work equal: a chunk is ``x @ W`` (one ``mm``), its backward two ``mm`` (the input's
and the weight's gradient; the first chunk's input needs its gradient too), and the kernel model charges ``MS`` =
1 ms per ``mm`` and nothing else (1 ms is a whole number of nanoseconds, the trace's resolution, and of
microseconds, the replay's unit, so every figure below is exact). So a chunk's forward is f = MS and its backward
b = 2 MS. Communication is free: the activations are empty (seq length 0: an ``mm`` of 0 rows still costs MS in
this model) and the replay's profile has no point-to-point overhead or latency (``p2p_overhead_us`` and
``intra_node.latency_us`` 0), so a transfer costs 0 + 0 bytes / bandwidth = 0 and the bubble is the schedule's alone.

Closed form (Narayanan et al. 2021, section 2.2.2). Every stage computes v m chunk passes per iteration, so its
compute is C = v m (f + b). The interleaved schedule's bubble is (p - 1) (f + b): p - 1 chunk passes of fill and
drain, each 1/v of a whole stage's pass. Hence bubble / compute = (p - 1) / (v m) and the step is
(v m + p - 1)(f + b). With f + b = 3 MS:

- p=2, v=2, m=4: compute 24 MS, bubble 3 MS, fraction 1/8, step 27 MS;
- p=4, v=2, m=8: compute 48 MS, bubble 9 MS, fraction 3/16, step 57 MS;
- and the control without interleaving (v=1: ``forward_backward_pipelining_without_interleaving``), p=2, m=4:
  compute 12 MS, bubble 3 MS, fraction 1/4 (v times the interleaved one at the same p and m), step 15 MS.

Hybrid, at p=4: stage 1 runs again as the real rank against the graph (``EmulationConfig.graph``), its virtual
peers arriving on its emulated clock when the replay says. With free transfers its steady step is the replay's,
57 MS, exactly (its own work is 48 MS: the 9 MS bubble comes from the replayed arrivals). With transfers at the
profile's cost c (6 us for 0 bytes) it is the replay's + 5 c: the live clock runs every op of a group one after the
other on that group's one communication stream (the sends to the next stage and the receives from the previous
one of a ``batch_isend_irecv`` included), the replay keeps one channel per point-to-point direction and peer
(`prism_plugin.graph.engine`), so the live rank's transfers queue 5 times per step where the replay's overlap (an
open difference of the two models, pinned here).

About 3 minutes (10 processes, each importing Megatron-core); a case's stages start together (one core each).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from children import run_child

from integration_tests.at_once import at_once
from prism_plugin.cost import CostModel, load_profile, override_profile
from prism_plugin.cost.profiles import profile_to_yaml
from prism_plugin.graph.convert import graph_from_rank_traces
from prism_plugin.graph.rank_trace import load_rank_traces
from prism_plugin.graph.slicing import parse_layout
from prism_plugin.graph.steady import steady_state

pytestmark = pytest.mark.slow

MS_US = 1000.0  # the kernel model's mm, in the replay's microseconds

STAGE = """
import json
from prism_plugin.device import cuda_runtime
cuda_runtime.preload()
import torch
import prism_plugin as P
from prism_plugin.config.emulation import EmulationConfig, VirtualWorld
from prism_plugin.cost.gpu import gpu_spec
from prism_plugin.device.device import VirtualGpu
PP, VPP, M, STAGE, TRACE, GRAPH, PROFILE = {pp}, {vpp}, {m}, {stage}, {trace!r}, {graph!r}, {profile!r}
MS, LAUNCH = 1e-3, 2.0**-17
S, B, H = 0, 1, 16  # empty activations: transfers of 0 bytes
def model(func, args, kwargs, out):
    return MS if func is torch.ops.aten.mm.default else None
out = {{}}
code = 0
try:
    vg = VirtualGpu(gpu_spec("h100-sxm"), num_devices=8).start()
    clock = vg.start_time(model, LAUNCH)
    P.activate(EmulationConfig(world=VirtualWorld(world_size=PP, real_ranks=(STAGE,), gpus_per_node=8),
                               profile=PROFILE, device="virtual-gpu", trace_dir=TRACE, graph=GRAPH),
               backend="nccl")
    torch.cuda.set_device(0)
    from megatron.core import parallel_state as ps
    from megatron.core.enums import ModelType
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.transformer_config import TransformerConfig
    ps.initialize_model_parallel(1, PP, VPP if VPP > 1 else None, create_gloo_process_groups=False)
    cfg = TransformerConfig(num_layers=PP * VPP, hidden_size=H, num_attention_heads=1,
                            pipeline_model_parallel_size=PP,
                            virtual_pipeline_model_parallel_size=VPP if VPP > 1 else None,
                            pipeline_dtype=torch.float32)

    class Chunk(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.config, self.model_type = cfg, ModelType.encoder_or_decoder
            self.weight = torch.nn.Parameter(torch.empty(H, H, device="cuda"))
            self.input_tensor = None
        def set_input_tensor(self, t):
            self.input_tensor = t[0] if isinstance(t, list) else t
        def forward(self):
            x = self.input_tensor
            if x is None:  # the first chunk: a fresh activation whose gradient is computed too
                x = torch.empty(S * B, H, device="cuda", requires_grad=True)
            return torch.mm(x.reshape(S * B, H), self.weight).view(S, B, H)

    chunks = [Chunk() for _ in range(VPP)]
    def forward_step(data_iterator, chunk):
        return chunk(), lambda output: (output.sum(), {{"loss": output.sum().detach()}})
    schedule = get_forward_backward_func()
    out["schedule"] = schedule.__name__
    for step in range(3):
        P.mark_iteration(step)
        schedule(forward_step_func=forward_step, data_iterator=[iter(range(M))] * VPP, model=chunks,
                 num_microbatches=M, seq_length=S, micro_batch_size=B)
        torch.cuda.synchronize()
    P.mark_iteration(3)
    summary = P.deactivate()
    out["kernels"] = clock.kernels
    out["steps"] = clock.step_times_s()
    out["graph"] = summary.get("graph")
    out["op_counts"] = summary["op_counts"]
except BaseException as exc:
    import traceback; traceback.print_exc()
    out["error"] = f"{{type(exc).__name__}}: {{exc}}"
    code = 1
print("RESULT " + json.dumps(out))
cuda_runtime.exit_now(code)
"""


@pytest.mark.parametrize(("pp", "vpp", "m"), [(2, 2, 4), pytest.param(4, 2, 8, marks=pytest.mark.heavy), (2, 1, 4)])
def test_interleaved_1f1b_bubble_is_p_minus_1_over_v_m(library: None, tmp_path: Path, pp: int, vpp: int,
                                                       m: int) -> None:
    trace = tmp_path / "trace"
    # the stages' processes at once (one core each; every figure is virtual time)
    outs = at_once(*(lambda stage=stage: run_child(STAGE.format(pp=pp, vpp=vpp, m=m, stage=stage, trace=str(trace),
                                                                graph=None, profile="dgx-h100"))
                     for stage in range(pp)))
    for out in outs:
        assert out["schedule"] == ("forward_backward_pipelining_with_interleaving" if vpp > 1 else
                                   "forward_backward_pipelining_without_interleaving")
        assert out["kernels"] == 3 * vpp * m * 3  # 3 iterations x v m chunk passes x 3 mm (1 forward, 2 backward)
        assert out["op_counts"]["send"] == out["op_counts"]["recv"] > 0
    graph = graph_from_rank_traces(load_rank_traces(sorted(trace.glob("rank*.trace.json"))),
                                   parse_layout(f"tp=1,pp={pp},dp=1", "megatron").world, ("pp",), warmup=1)
    free_p2p = override_profile(load_profile("dgx-h100"), {"p2p_overhead_us": 0.0, "intra_node.latency_us": 0.0})
    state = steady_state(graph, CostModel(free_p2p))
    f_plus_b = 3 * MS_US
    for stage in range(pp):
        b = state.breakdown(stage)
        assert b.compute_us == vpp * m * f_plus_b
        assert b.exposed_comm_us == 0.0
        assert b.bubble_us == (pp - 1) * f_plus_b
        assert b.bubble_us / b.compute_us == (pp - 1) / (vpp * m)
        assert b.iteration_us == (vpp * m + pp - 1) * f_plus_b
    assert state.step_us == (vpp * m + pp - 1) * f_plus_b
    if pp < 4:
        return
    # hybrid: stage 1 again as the real rank against the graph; stages 0, 2 and 3 arrive on its emulated clock
    # when the replay (on the run's own profile) says
    path = tmp_path / "job.graph"
    graph.save(path)
    free_yaml = tmp_path / "free-p2p.yaml"
    free_yaml.write_text(profile_to_yaml(free_p2p))

    def hybrid(profile: str) -> float:
        out = run_child(STAGE.format(pp=pp, vpp=vpp, m=m, stage=1, trace=None, graph=str(path), profile=profile))
        assert out["graph"]["ops_replayed"] > 0 and out["graph"]["ops_outside_graph"] == 0
        return round(out["steps"][-1] * 1e6, 3)  # the summary's 1 ns

    # free transfers: the replay's step exactly, bubble included (its own ops alone take 48 MS)
    assert hybrid(str(free_yaml)) == state.step_us == (vpp * m + pp - 1) * f_plus_b
    # transfers at the profile's cost c = 6 us (p2p overhead + NVLink latency, 0 bytes): the live clock queues all
    # of the pipeline group's ops on one communication stream, the replay one channel per direction and peer:
    # the live step is 5 c longer (measured; see the module docstring)
    replay = steady_state(graph, CostModel(load_profile("dgx-h100")))
    c = CostModel(load_profile("dgx-h100")).p2p_us(0, 1, 2)
    assert c == 6.0 and replay.breakdown(1).iteration_us == 57150.0
    assert hybrid("dgx-h100") == replay.breakdown(1).iteration_us + 5 * c
