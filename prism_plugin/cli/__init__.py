"""The `prism` command line: one module per verb group (`main`: run, profiles, megatron; `graph`: slice, profile,
graph, replay; `recipes`: recipe; `calibrate`: calibrate)."""
