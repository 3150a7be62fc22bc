"""Validation harnesses: real runs against emulated runs of the same job (not library code).

`pipeline` (a slept 1F1B torch program) and `framework` (Megatron-core and DeepSpeed pp=2 jobs): each runs
real runs, builds the execution graph from their traces, replays it and runs hybrid ranks, and returns
the errors. Run from the repository root (`integration_tests/graph/`, `benchmarks/graph_validation.py`).
"""
