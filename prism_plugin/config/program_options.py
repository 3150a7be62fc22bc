"""The settings a program's emulation takes beyond the launch (pure values; read by the Megatron adapter).

- ``--prism-moe-routing`` / ``PRISM_MOE_ROUTING``: how many tokens each expert receives on virtual GPUs
  (`parse_routing`; the policy itself is `prism_plugin.adapters.megatron.moe`);
- ``--prism-attention`` / ``PRISM_ATTENTION``: Megatron's local attention as written, or the fused stand-in
  (`parse_attention`; the stand-in is `prism_plugin.adapters.megatron.attention`).

Both are parsed here so that a launcher checks them before any process starts (`prism_plugin.launch.preflight.
check_environment`), whatever program runs.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from prism_plugin.config.errors import ConfigError

__all__ = ["ATTENTION_ENV", "ROUTING_ENV", "AttentionMode", "RoutingSpec", "parse_attention", "parse_routing"]

ROUTING_ENV = "PRISM_MOE_ROUTING"
ATTENTION_ENV = "PRISM_ATTENTION"


@dataclass(frozen=True, kw_only=True, slots=True)
class RoutingSpec:
    """A parsed ``--prism-moe-routing`` value."""

    kind: str
    """``balanced`` or ``skew``."""
    seed: int = 0
    alpha: float = 1.0

    @property
    def name(self) -> str:
        return "balanced" if self.kind == "balanced" else f"skew:{self.seed},{self.alpha:g}"


def parse_routing(text: str | None) -> RoutingSpec:
    """``balanced`` (also None / empty) or ``skew:SEED[,ALPHA]``; a `ConfigError` naming the flag otherwise."""
    if text is None or text.strip() in ("", "balanced"):
        return RoutingSpec(kind="balanced")
    kind, _, rest = text.strip().partition(":")
    if kind == "skew" and rest:
        seed_text, _, alpha_text = rest.partition(",")
        try:
            seed = int(seed_text)
            alpha = float(alpha_text) if alpha_text else 1.0
        except ValueError:
            seed, alpha = -1, -1.0
        if seed >= 0 and math.isfinite(alpha) and alpha >= 0.0:
            return RoutingSpec(kind="skew", seed=seed, alpha=alpha)
    raise ConfigError(f"--prism-moe-routing {text!r}: expected 'balanced' or 'skew:SEED[,ALPHA]' (SEED an integer "
                      ">= 0, ALPHA a finite number >= 0, default 1.0), e.g. --prism-moe-routing skew:7,1.2")




class AttentionMode(enum.Enum):
    LOCAL = "local"
    """The program's own kernels (Megatron's DotProductAttention as written)."""
    FLASH = "flash"
    """The fused-attention stand-in (virtual GPUs)."""


def parse_attention(text: str) -> AttentionMode:
    """``local`` or ``flash`` (any case); a `ConfigError` naming the flag and the variable otherwise."""
    try:
        return AttentionMode(text.strip().lower())
    except ValueError:
        raise ConfigError(f"--prism-attention / {ATTENTION_ENV} {text!r}: choose flash (the fused-attention stand-in, "
                          "virtual GPUs) or local (the program's own kernels)") from None
