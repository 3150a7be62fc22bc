"""DeepSpeed under emulation: a ``"prism"`` section in ds_config plus one drop-in call.

::

    import prism_plugin.deepspeed as prism_ds
    prism_ds.init_distributed(ds_config)        # instead of deepspeed.init_distributed()
    ...                                         # the unmodified DeepSpeed training script
    summary = prism_ds.shutdown()               # optional: also runs at exit

The implementation lives in `prism_plugin.adapters.deepspeed`; this module only re-exports it.

``python -m prism_plugin.deepspeed script.py args`` is the virtual-GPU entry that ``init_distributed`` re-executes
a process through for ``"device": "virtual-gpu"`` (`prism_plugin.adapters.deepspeed.virtual_gpu`): it loads the
CUDA device library before torch is imported.
"""

import sys

if __name__ == "__main__":  # the virtual-GPU entry: the device library before anything imports torch
    from prism_plugin.device import cuda_runtime

    cuda_runtime.preload_if_launched()

from prism_plugin.adapters.deepspeed import (  # noqa: E402
    ALLOWED_KEYS,
    DeepSpeedEmulation,
    PrismSection,
    TensorSpec,
    active,
    init_distributed,
    maybe_init_distributed,
    parse_section,
    shutdown,
)

__all__ = ["ALLOWED_KEYS", "DeepSpeedEmulation", "PrismSection", "TensorSpec", "active", "init_distributed",
           "maybe_init_distributed", "parse_section", "shutdown"]

if __name__ == "__main__":
    from prism_plugin.adapters.deepspeed.virtual_gpu import main

    main(sys.argv[1:])
