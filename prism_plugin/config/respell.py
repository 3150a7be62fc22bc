"""How each entry point spells a setting in its messages (pure; the table is `prism_plugin.config.settings`).

The layers below the entry points write settings as ``prism run`` does (`RUN_FLAGS`); an entry point that spells
them otherwise re-spells the message (`respell`) with its own mapping (`prism_plugin.config.resolve.spellings`).
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["DEFAULT_PROFILE", "RUN_FLAGS", "default_profile_note", "respell", "spell"]

RUN_FLAGS: Mapping[str, str] = {
    "world_size": "--world-size", "output_dir": "--output", "record_dir": "--record", "replay_dir": "--replay",
    "trace_dir": "--trace", "graph": "--graph", "real_ranks": "--real-ranks", "gpus_per_node": "--gpus-per-node",
    "profile": "--profile", "gpu": "--gpu", "device": "--device", "data_policy": "--data-policy",
}
"""How `prism run` spells each EmulationConfig field (the default of every check). Messages of the layers below
the entry points name settings this way; an entry point that spells them otherwise passes its own mapping or
re-spells the message (`respell`)."""


def spell(flags: Mapping[str, str], field: str, value: object | None = None) -> str:
    """How the entry point of `flags` writes `field` (set to `value`): a flag, or a key of a config section.

    Example: ``spell(RUN_FLAGS, "profile", "dgx-h100") == "--profile dgx-h100"``; with the DeepSpeed section's
    mapping (``'"prism.profile"'``): ``'"prism.profile": "dgx-h100"'``.
    """
    name = flags.get(field, RUN_FLAGS.get(field, field))
    if value is None:
        return name
    if name.startswith("-"):
        return f"{name} {value}"
    return f"{name}: {value}" if isinstance(value, int | float) else f'{name}: "{value}"'


DEFAULT_PROFILE = "dgx-h100"
"""The hardware profile of a virtual-GPU launch that names neither a profile nor a GPU model: a policy default
(H100 SXM, 8 per node: the GPU of Megatron-LM's own functional tests and most published large training runs)."""


def default_profile_note(flags: Mapping[str, str]) -> str:
    """The one line a launcher says when `DEFAULT_PROFILE` applies, the settings spelled as `flags` spells them."""
    return (f"prism: {spell(flags, 'device', 'virtual-gpu')} without {spell(flags, 'profile')} or "
            f"{spell(flags, 'gpu')}: running on profile {DEFAULT_PROFILE} (8 H100 SXM per node, its links and "
            f"kernel figures); name another with {spell(flags, 'profile', '<name>')}")


def respell(message: str, flags: Mapping[str, str]) -> str:
    """`message` with each of `prism run`'s flags (`RUN_FLAGS`) written as the entry point of `flags` writes it,
    a value right after the flag kept with it.

    Example: ``respell("e.g. --world-size 8192", {"world_size": "--prism-world-size"}) == "e.g.
    --prism-world-size 8192"``; with ``'"prism.world_size"'``: ``'e.g. "prism.world_size": 8192'``.
    """
    import re

    for field, run_flag in RUN_FLAGS.items():
        if field not in flags or flags[field] == run_flag:
            continue

        def one(match: re.Match[str], field: str = field) -> str:
            value = match.group(1)
            if value is None:
                return spell(flags, field)
            return spell(flags, field, int(value) if value.isdigit() else value)

        message = re.sub(rf"(?<![\w-]){re.escape(run_flag)}(?![\w-])(?: ([\w./:-]*\w))?", one, message)
    return message
