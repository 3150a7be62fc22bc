"""`prism models`: the model presets (``prism_plugin.config.models``) and the Megatron arguments of each.

    prism models                      # a table: name, family, layers, hidden, heads/kv, ffn, vocab, seq, params
    prism models --json               # every preset with its exact parameter count and Megatron arguments
    prism models show llama3-70b      # one preset, and its pretrain_gpt.py arguments as one line to paste
    prism models show llama3-70b --json

An unknown name exits 2 naming every preset. The parameter counts are the unsharded, unpadded model's
(`prism_plugin.config.models.parameters`); Megatron's own count adds its vocabulary padding.
"""

from __future__ import annotations

import argparse
import json
import shlex
from typing import Any

from rich.console import Console
from rich.table import Table

from prism_plugin.config.models import PRESETS, ModelPreset, megatron_args, parameters, preset

__all__ = ["add_models_parser", "preset_record"]


def preset_record(p: ModelPreset) -> dict[str, Any]:
    """One preset as JSON-ready data: every field (enums by value), ``head_dim``, ``parameters`` (exact) and
    ``megatron_args`` (a list of strings)."""
    record: dict[str, Any] = {}
    for name in ModelPreset.__dataclass_fields__:
        value = getattr(p, name)
        record[name] = getattr(value, "value", value)
    record["head_dim"] = p.head_dim
    record["parameters"] = parameters(p)
    record["megatron_args"] = megatron_args(p)
    return record


def _short_source(source: str) -> str:
    """``huggingface.co/<org>/<repo>`` for a Hugging Face config URL, else the text up to its first ``;``."""
    prefix = "https://huggingface.co/"
    if source.startswith(prefix):
        return "huggingface.co/" + "/".join(source[len(prefix):].split("/")[:2])
    return source.split(";")[0]


def _out() -> Console:
    # a pipe or a test's capture is not a terminal: wide enough that no row wraps
    return Console(width=None if Console().is_terminal else 200)


def _cmd_list(args: argparse.Namespace) -> int:
    if args.json:
        print(json.dumps([preset_record(p) for p in PRESETS.values()], indent=2))
        return 0
    table = Table(title="model presets (parameters: exact, unsharded, unpadded vocabulary)")
    for col in ("name", "family", "layers", "hidden", "heads/kv", "ffn", "experts", "vocab", "seq", "params"):
        table.add_column(col, justify="left" if col in ("name", "family") else "right", no_wrap=True)
    table.add_column("source", overflow="fold")
    for p in PRESETS.values():
        experts = f"{p.num_experts} top-{p.moe_router_topk}" if p.is_moe else "-"
        table.add_row(p.name, p.family, str(p.num_layers), str(p.hidden_size),
                      f"{p.num_attention_heads}/{p.num_query_groups}", str(p.ffn_hidden_size), experts,
                      f"{p.vocab_size:,}", str(p.seq_length), f"{parameters(p):,}", _short_source(p.source))
    table.caption = "prism models show NAME: one preset and its pretrain_gpt.py arguments"
    _out().print(table)
    return 0


def _cmd_show(args: argparse.Namespace) -> int:
    p = preset(args.name)  # ConfigError naming every preset: main prints it and exits 2
    record = preset_record(p)
    if args.json:
        print(json.dumps(record, indent=2))
        return 0
    width = max(len(k) for k in record)
    for key, value in record.items():
        if key == "megatron_args":
            continue
        shown = f"{value:,}" if key == "parameters" else ("-" if value is None else value)
        print(f"{key:<{width}}  {shown}")
    print()
    print("# pretrain_gpt.py arguments (architecture only; add the layout, batch, steps, precision and data):")
    print(shlex.join(record["megatron_args"]))
    return 0


def add_models_parser(sub: Any) -> None:
    """Add ``prism models [--json]`` and ``prism models show NAME [--json]`` to the `prism` subparsers."""
    models = sub.add_parser("models", help="list the model presets (published architectures), or show one")
    models.add_argument("--json", action="store_true", help="print JSON instead of a table")
    models.set_defaults(func=_cmd_list)
    actions = models.add_subparsers(dest="models_command")
    show = actions.add_parser("show", help="one preset and its Megatron pretrain_gpt.py arguments")
    show.add_argument("name", help="a preset name, e.g. llama3-70b (see `prism models`)")
    show.add_argument("--json", action="store_true", help="print the preset as JSON")
    show.set_defaults(func=_cmd_show)
