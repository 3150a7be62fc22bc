"""The configuration reference, generated from the settings table: ``python -m prism_plugin.config.reference``.

It writes ``docs/configuration.md`` (``--check`` exits 1 when the file differs from what the table gives, as CI's
test does): every setting in every spelling, its default, what it takes, grouped as the nested `Settings` is.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from prism_plugin.config.settings import SETTINGS, Entry, Group, Setting

__all__ = ["DOC_PATH", "markdown", "write_generated"]

DOC_PATH = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"

_TITLES = {Group.WORLD: "World", Group.DEVICE: "Device", Group.TIME: "Time",
           Group.DATA: "Data of virtual participants", Group.OUTPUTS: "Outputs", Group.FAULTS: "Faults",
           Group.MEGATRON: "Megatron", Group.DEEPSPEED: "DeepSpeed"}


def _cell(setting: Setting, entry: Entry) -> str:
    if entry not in setting.entries:
        return "-"
    metavar = "{" + setting.metavar.replace("|", ",") + "}" if "|" in setting.metavar else setting.metavar
    text = f"`{setting.spelled(entry)} {metavar}`"
    if setting.switch:
        text += f", `{'--prism-' if entry is Entry.DROP_IN else '--'}{setting.switch}`"
    if entry is Entry.DEEPSPEED:
        text = f'`"{setting.name}"`' + "".join(f', `"{a}"`' for a in setting.aliases)
    return text


def _default(setting: Setting) -> str:
    if setting.default is None or setting.default == ():
        return "unset"
    if isinstance(setting.default, bool):
        return "on" if setting.default else "off"
    return f"`{setting.default}`"


def markdown() -> str:
    """The reference page, from `SETTINGS`."""
    lines = [
        "# Configuration reference",
        "",
        "Generated from `prism_plugin/config/settings.py` by `python -m prism_plugin.config.reference`; do not edit.",
        "",
        "Every setting has one name. The `prism` commands write it `--name-in-kebab-case`, the Megatron drop-in "
        "`--prism-name`, the DeepSpeed config's `\"prism\"` section `\"name\"`. Settings with a variable also take it "
        "as a documented alias (a flag or key given with it wins); the launcher hands it to the rank processes. "
        "Everything is checked once, in the launcher, before any process starts. Required: `world_size`, "
        "`real_ranks`.",
        "",
    ]
    for group in Group:
        rows = [s for s in SETTINGS if s.group is group]
        lines += [f"## {_TITLES[group]}", "",
                  "| setting | `prism` | drop-in | DeepSpeed | variable | default | what it takes |",
                  "|---|---|---|---|---|---|---|"]
        for s in rows:
            env = f"`{s.env}`" if s.env else "-"
            lines.append(f"| `{s.name}` | {_cell(s, Entry.RUN)} | {_cell(s, Entry.DROP_IN)} | "
                         f"{_cell(s, Entry.DEEPSPEED)} | {env} | {_default(s)} | {s.help.replace('|', '/')} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m prism_plugin.config.reference", description=__doc__)
    ap.add_argument("--output", "--out", type=Path, default=DOC_PATH)
    ap.add_argument("--check", action="store_true", help="exit 1 if --output differs from the table")
    args = ap.parse_args(argv)
    return write_generated(args.output, markdown(), check=args.check, command="python -m prism_plugin.config.reference")


def write_generated(path: Path, text: str, *, check: bool, command: str) -> int:
    """Write a generated document (`text`) to `path`, or with `check` compare them: exit status 1 and a line naming
    `command` when the file is stale (the reference page, the summary schema)."""
    if check:
        if not path.is_file() or path.read_text() != text:
            print(f"{path} is stale: run {command}", file=sys.stderr)
            return 1
        return 0
    path.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
