"""The graph layer's user-input error: a graph file, layout string, rank trace or slicing plan it refuses.

`GraphError` is a `ConfigError` (hence a `ValueError`): the `prism` CLI prints it and exits 2. Its message
names the file where one was read (``graph file job.graph: ...``, ``rank trace file t/rank3.trace.json:
...``, ``plan file plan.json: ...``), then the field and the fix. `prism_plugin.graph.engine.ReplayMismatch`
(class traces that disagree on an op) is one; `ReplayDeadlock` (a graph whose ranks wait on each other) is a
`RuntimeError`, the outcome of a replay rather than a malformed input.

Pure: stdlib and prism_plugin.config only.
"""

from __future__ import annotations

from prism_plugin.config.errors import ConfigError

__all__ = ["GraphError"]


class GraphError(ConfigError):
    """Graph-layer input that cannot be used; the message names the file (if any), the field and the fix."""
