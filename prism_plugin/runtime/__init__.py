"""The runtime layer: what one real process runs while it emulates rank r of N.

Modules: `session` (the process-wide owner of an active emulation: activate / deactivate), `lifecycle`
(real processes' store, run, summary, the launcher's child watching and signals), `bootstrap` and `launch`
(`prism run`), `clock` (the op clock behind the comm seam), `tracer` (trace capture), `arrivals` (replayed
virtual arrivals: hybrid emulation), `live_faults`, `memory` (the CPU tensor-storage tracker), `calibrate`
(timing the local backend). Imports comm, graph, cost, config; never the frameworks.
"""
