"""The `prism` command line's setting flags, derived from the settings table (`prism_plugin.config.settings`).

`add_setting_arguments` adds one flag per setting (``--world-size``, ``--fault`` once per fault, ``--no-timing``);
`given_settings` reads back the ones a user gave, for `prism_plugin.config.resolve.resolve` to check.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable

from prism_plugin.config.settings import SETTINGS, Entry

__all__ = ["add_setting_arguments", "given_settings"]


def add_setting_arguments(parser: argparse.ArgumentParser, names: Iterable[str] | None = None) -> None:
    """One flag per setting of the command line (those of `names` when given), each defaulting to None (unset:
    the resolver fills the environment alias or the default)."""
    wanted = None if names is None else set(names)
    group = parser.add_argument_group("settings (docs/configuration.md)")
    for s in SETTINGS:
        if Entry.RUN not in s.entries or (wanted is not None and s.name not in wanted):
            continue
        if s.repeatable:
            group.add_argument(s.spelled(Entry.RUN), dest=s.name, action="append", default=None, metavar=s.metavar,
                               help=s.help + " Repeatable.")
            continue
        group.add_argument(s.spelled(Entry.RUN), dest=s.name, default=None, metavar=s.metavar, help=s.help)
        if s.switch:
            group.add_argument(f"--{s.switch}", dest=s.name, action="store_const", const=False,
                               help=f"the same as {s.spelled(Entry.RUN)} off")


def given_settings(args: argparse.Namespace, names: Iterable[str] | None = None) -> dict[str, object]:
    """The settings `args` gave (by name; those of `names` when given, as `add_setting_arguments` took), for
    `resolve`."""
    wanted = None if names is None else set(names)
    return {s.name: getattr(args, s.name) for s in SETTINGS
            if Entry.RUN in s.entries and (wanted is None or s.name in wanted)
            and getattr(args, s.name, None) is not None}
