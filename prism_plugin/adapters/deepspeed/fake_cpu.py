"""A DeepSpeed program on fake CPU tensors (`prism_plugin.runtime.fake_cpu`) with the DeepSpeed adapter's stated
answers installed first (`prism_plugin.adapters.deepspeed.virtual_gpu.install`: ZeRO's overflow and invalid-norm
flags read 0, as on a virtual GPU)::

    python -m prism_plugin.adapters.deepspeed.fake_cpu -m prism_plugin.recipes.probe \\
        -m prism_plugin.programs.deepspeed_mlp ...
"""

from __future__ import annotations

from prism_plugin.adapters.deepspeed import virtual_gpu
from prism_plugin.runtime import fake_cpu

__all__ = ["main"]


def main(argv: list[str] | None = None) -> None:
    fake_cpu.main(argv, install=virtual_gpu.install)


if __name__ == "__main__":
    main()
