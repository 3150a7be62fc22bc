"""The pure graph layer: execution-graph schema, builders, symmetric replay, timeline export.

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
from prism_plugin.graph.export import chrome_trace, write_chrome_trace
from prism_plugin.graph.fold import Actor, ActorSpace, ReplayMode, fold
from prism_plugin.graph.layout import AxisSpec, WorldLayout
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
from prism_plugin.graph.synthetic import GradSync, SyntheticJob, build_1f1b_graph

__all__ = [
    "SCHEMA_VERSION",
    "Actor",
    "ActorSpace",
    "AxisSpec",
    "ClassTrace",
    "ConcreteOp",
    "ExecutionGraph",
    "GradSync",
    "Node",
    "NodeKind",
    "OpSpan",
    "RankBreakdown",
    "RankOverride",
    "ReplayDeadlock",
    "ReplayMismatch",
    "ReplayMode",
    "ReplayResult",
    "SyntheticJob",
    "TraceBuilder",
    "WorldLayout",
    "build_1f1b_graph",
    "chrome_trace",
    "fold",
    "graph_from_traces",
    "instantiate_rank",
    "replay",
    "representatives",
    "rule_class_name",
    "write_chrome_trace",
]
