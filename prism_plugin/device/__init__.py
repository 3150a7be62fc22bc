"""Virtual GPUs (DESIGN.md section 10): fake CUDA tensors, a CUDA runtime shim, the allocator model, values.

Modules: `cuda_runtime` (the CUDA device library for the CPU wheel; loads before torch), `device` (`VirtualGpu`,
the one entry), `shim` (``torch.cuda``), `values` (the value policy). This package imports nothing itself, so
`cuda_runtime.preload()` can run before torch is imported.
"""
