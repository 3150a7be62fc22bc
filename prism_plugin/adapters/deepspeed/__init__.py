"""The DeepSpeed adapter: ZeRO and pipeline engines as k real ranks of N (DeepSpeed 0.19.x).

Public entry points (re-exported by `prism_plugin.deepspeed`): `init_distributed(config)`, the drop-in
for ``deepspeed.init_distributed()`` that reads the ds_config's ``"prism"`` section; `shutdown()`;
`parse_section` to validate a section without starting anything. See `runtime` for the seams and
`section` for the keys. Only this package imports DeepSpeed.
"""

from prism_plugin.adapters.deepspeed.runtime import (
    DeepSpeedEmulation,
    active,
    init_distributed,
    maybe_init_distributed,
    shutdown,
)
from prism_plugin.adapters.deepspeed.section import ALLOWED_KEYS, PrismSection, TensorSpec, parse_section

__all__ = ["ALLOWED_KEYS", "DeepSpeedEmulation", "PrismSection", "TensorSpec", "active", "init_distributed",
           "maybe_init_distributed", "parse_section", "shutdown"]
