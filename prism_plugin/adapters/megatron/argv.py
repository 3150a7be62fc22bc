"""A Megatron job's argument list, read and rewritten flag by flag (the drop-in's `absent_data` and `job_length`).

A flag's values are the tokens after it up to the next ``--`` token (``--flag a b``), or the text after ``=``
(``--flag=a``).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["flag_values", "without_flags"]


def flag_values(argv: Sequence[str], flag: str) -> list[str]:
    """The values given to `flag` (``--flag a b`` or ``--flag=a``), [] when absent."""
    out: list[str] = []
    for i, token in enumerate(argv):
        if token == flag:
            j = i + 1
            while j < len(argv) and not argv[j].startswith("--"):
                out.append(argv[j])
                j += 1
        elif token.startswith(flag + "="):
            out.append(token.split("=", 1)[1])
    return out


def without_flags(argv: Sequence[str], flags: Sequence[str]) -> list[str]:
    """`argv` without `flags` and their values."""
    out: list[str] = []
    skipping = False
    for token in argv:
        if token.startswith("--"):
            skipping = token.split("=", 1)[0] in flags
            if skipping:
                continue
        elif skipping:
            continue
        out.append(token)
    return out
