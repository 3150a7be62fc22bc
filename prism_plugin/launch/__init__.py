"""The launcher: the parent process of every entry point that starts real ranks itself (DESIGN.md section 3).

Modules: `preflight` (every check a launch makes before any process starts), `launcher` (`prism run`: start the
real ranks of an N-rank program through `prism_plugin.runtime.bootstrap`), `processes` (the child-watch loop
shared by every launcher: process groups, signals, the first failure, parent-death). The rank process itself is
`prism_plugin.runtime`; the virtual GPU it may run is `prism_plugin.device`.
"""
