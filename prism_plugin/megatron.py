"""``python -m prism_plugin.megatron script.py <megatron args> --prism-world-size N --prism-real-ranks ...``.

A thin entry point: the wrapper lives in `prism_plugin.adapters.megatron.wrapper` (the only
place that imports Megatron). See that module for the flags and what happens before the script runs.
"""

from __future__ import annotations

import sys

if __name__ == "__main__":
    from prism_plugin.adapters.megatron.wrapper import main

    sys.exit(main())
