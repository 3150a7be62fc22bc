"""DeepSpeed under emulation: a ``"prism"`` section in ds_config plus one drop-in call.

::

    import prism_plugin.deepspeed as prism_ds
    prism_ds.init_distributed(ds_config)        # instead of deepspeed.init_distributed()
    ...                                         # the unmodified DeepSpeed training script
    summary = prism_ds.shutdown()               # optional: also runs at exit

The implementation lives in `prism_plugin.adapters.deepspeed`; this module only re-exports it.
"""

from prism_plugin.adapters.deepspeed import (
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
