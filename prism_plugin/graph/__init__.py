"""The pure graph layer: execution-graph schema, builders, symmetric replay, timeline export.

Modules: `errors` (`GraphError`, the layer's user-input error), `schema` (versioned graph format),
`layout` (rank grid), `build` (class traces, representatives), `rank_trace` (what trace capture writes per
real rank), `convert` (rank traces -> class traces -> graph),
`slicing` (classes and profiling runs for K devices), `fold` + `replay` + `result` (discrete-event replay),
`steady` (chained iterations, step times, live ranks' arrival tables), `export` (Chrome trace),
`synthetic` (a Megatron-style 1F1B job).

Example::

    from prism_plugin.cost import CostModel, load_profile
    from prism_plugin.graph import SyntheticJob, build_1f1b_graph, replay

    job = SyntheticJob(tp=8, pp=16, dp=64, num_microbatches=64, fwd_us=1000.0, bwd_us=2000.0,
                       activation_bytes=2**26, grad_bytes=2**30)
    result = replay(build_1f1b_graph(job), CostModel(load_profile("dgx-h100")), stragglers={4100: 1.5})
    result.iteration_time_us(), result.breakdown(0), result.arrival_offset_us(0, "dp", 0)

Pure: imports nothing from torch, torch.distributed, Megatron or DeepSpeed.
"""

from prism_plugin.graph.build import (
    ConcreteOp,
    TraceBuilder,
    graph_from_traces,
    instantiate_rank,
    representatives,
)
from prism_plugin.graph.convert import class_trace, graph_from_rank_traces, group_role, peer_step
from prism_plugin.graph.errors import GraphError
from prism_plugin.graph.export import chrome_trace, write_chrome_trace
from prism_plugin.graph.fold import Actor, ActorSpace, ReplayMode, fold
from prism_plugin.graph.layout import AxisSpec, WorldLayout
from prism_plugin.graph.rank_trace import RankTrace, TracedIteration, TracedOp, load_rank_traces
from prism_plugin.graph.replay import (
    OpSpan,
    RankBreakdown,
    ReplayDeadlock,
    ReplayMismatch,
    ReplayResult,
    replay,
)
from prism_plugin.graph.schema import (
    SCHEMA_VERSION,
    ClassTrace,
    ExecutionGraph,
    Node,
    NodeKind,
    RankOverride,
    rule_class_name,
)
from prism_plugin.graph.slicing import Framework, JobLayout, SlicingPlan, make_plan, parse_layout
from prism_plugin.graph.steady import ArrivalTable, SteadyState, steady_state, unroll
from prism_plugin.graph.synthetic import GradSync, SyntheticJob, build_1f1b_graph

__all__ = [
    "SCHEMA_VERSION",
    "Actor",
    "ActorSpace",
    "ArrivalTable",
    "AxisSpec",
    "ClassTrace",
    "ConcreteOp",
    "ExecutionGraph",
    "Framework",
    "GradSync",
    "GraphError",
    "JobLayout",
    "Node",
    "NodeKind",
    "OpSpan",
    "RankBreakdown",
    "RankOverride",
    "RankTrace",
    "ReplayDeadlock",
    "ReplayMismatch",
    "ReplayMode",
    "ReplayResult",
    "SlicingPlan",
    "SteadyState",
    "SyntheticJob",
    "TraceBuilder",
    "TracedIteration",
    "TracedOp",
    "WorldLayout",
    "build_1f1b_graph",
    "chrome_trace",
    "class_trace",
    "fold",
    "graph_from_rank_traces",
    "graph_from_traces",
    "group_role",
    "instantiate_rank",
    "load_rank_traces",
    "make_plan",
    "parse_layout",
    "peer_step",
    "replay",
    "representatives",
    "rule_class_name",
    "steady_state",
    "unroll",
    "write_chrome_trace",
]
