"""Megatron-LM's own functional tests on DGX H100 as validation rows for virtual GPUs.

Each row (``cases/<case>.yaml``) is one training case of Megatron-LM's functional tests, branch
``core_r0.19.0``: its arguments (from the case's ``model_config.yaml``, data and checkpoint paths replaced by
mock data) and two figures NVIDIA measured on a DGX H100 and logged by the last rank (the rank that owns
Megatron's TensorBoard writer): ``mem-max-allocated-bytes`` (``torch.cuda.memory_stats()
["allocated_bytes.all.peak"]``) and ``iteration-time``. Every third case by name is a ``fit`` row (`collect.role`):
the hardware profile's host time per launch is fitted on their iteration times (`fit`); the rest validate.

- `collect` writes the rows from a clone of Megatron-LM (``python -m validation.megatron_functional.collect``).
- `fit` fits the host time per launch on the fit rows' runs (``python -m validation.megatron_functional.fit``).
- `run` runs each row's arguments through the Megatron drop-in on a virtual H100 as the last rank and prints
  the measured-vs-predicted table (``python -m validation.megatron_functional.run``).

Cases whose names end in ``_memory_speed`` are never read: they are kept aside for an independent check.
"""
