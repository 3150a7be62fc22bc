"""The published summary schema (``docs/summary.schema.json``) held against the summaries real runs write."""

from __future__ import annotations

import json
from typing import Any

import jsonschema

from prism_plugin.runtime.summary import SCHEMA_PATH


def assert_published_schema(summary: dict[str, Any]) -> None:
    """`summary` (a rank's ``rank<R>.summary.json``) validates against the published JSON schema."""
    jsonschema.validate(summary, json.loads(SCHEMA_PATH.read_text()))
