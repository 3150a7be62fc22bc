"""Reading recipes from YAML into `prism_plugin.recipes.schema.Recipe`, with errors naming file and field.

Unknown fields get a did-you-mean, missing required ones name the dataclass to read, malformed YAML names
the line and column, a key given twice in one mapping names both lines (plain YAML keeps the last
silently), and `load_recipe` also loads every emulation's hardware profile, so a bad profile name or path
fails before anything runs. Pure: stdlib, pyyaml and the cost layer.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from prism_plugin.config.kinds import DeviceMode
from prism_plugin.recipes.schema import (
    Emulation,
    Expect,
    Layout,
    ModelSpec,
    Noise,
    RealRun,
    Recipe,
    RecipeError,
    Steps,
    Tolerances,
)

__all__ = ["load_recipe", "recipe_from_mapping", "recipe_from_yaml"]

_NESTED: dict[str, Any] = {"model": ModelSpec, "layout": Layout, "steps": Steps, "real": RealRun,
                           "tolerances": Tolerances}


def _fields(cls: Any) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls) if f.name != "source")


def _required(cls: Any) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls)
                 if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)


def _build(cls: Any, data: Any, where: str) -> Any:
    if not isinstance(data, Mapping):
        raise RecipeError(f"{where} must be a mapping of field: value, got {data!r}")
    known = _fields(cls)
    for key in data:
        if key not in known and not (cls is Emulation and key == "timeout_s"):
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f"did you mean `{close[0]}`?" if close else f"known fields: {', '.join(known)}"
            raise RecipeError(f"{where}: unknown field `{key}`; {hint}")
    for key in _required(cls):
        if key not in data:
            raise RecipeError(f"{where}: missing field `{key}` (see prism_plugin/recipes/schema.py, {cls.__name__})")
    kwargs = dict(data)
    if cls is Emulation and "timeout_s" in kwargs:  # the older key of the setting `timeout`
        if "timeout" in kwargs:
            raise RecipeError(f"{where}: timeout and timeout_s (its older key) are both given; keep timeout")
        kwargs["timeout"] = kwargs.pop("timeout_s")
    if cls is Tolerances and kwargs.get("noise") is not None:
        kwargs["noise"] = _build(Noise, kwargs["noise"], f"{where}.noise")
    if cls is Emulation and kwargs.get("tolerances") is not None:
        kwargs["tolerances"] = _build(Tolerances, kwargs["tolerances"], f"{where}.tolerances")
    if cls is Emulation and kwargs.get("expect") is not None:
        kwargs["expect"] = _build(Expect, kwargs["expect"], f"{where}.expect")
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise RecipeError(f"{where}: {exc}") from None


def recipe_from_mapping(data: Any, *, source: Path | None = None) -> Recipe:
    """Build a `Recipe` from parsed YAML (errors name `source` and the field)."""
    where = str(source) if source is not None else "<recipe>"
    try:
        if not isinstance(data, Mapping):
            raise RecipeError(f"a recipe is a YAML mapping (name:, framework:, ...), got {type(data).__name__}")
        top = dict(data)
        if top.get("real") == "none":
            top["real"] = RealRun.none()  # `real: none`: an emulation-only recipe (virtual GPUs)
        for key, cls in _NESTED.items():
            if key == "real" and isinstance(top.get(key), RealRun):
                continue
            if key in top:
                top[key] = _build(cls, top[key], key)
        if "emulated" in top:
            emus = top["emulated"]
            if isinstance(emus, Mapping):
                emus = [emus]
            if not isinstance(emus, list):
                raise RecipeError("emulated must be a list of emulations (name, world_size, runs, ...)")
            top["emulated"] = tuple(_build(Emulation, e, f"emulated[{i}]") for i, e in enumerate(emus))
        if "tolerances" not in top:
            top["tolerances"] = Tolerances()
        recipe = _build(Recipe, top, "recipe")
        return dataclasses.replace(recipe, source=source) if source is not None else recipe
    except RecipeError as exc:
        raise RecipeError(f"{where}: {exc}") from None


class _DuplicateKey(yaml.constructor.ConstructorError):
    pass


class _UniqueKeyLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` refusing a mapping that gives one key twice (``<<`` merges are left to PyYAML)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, yaml.Node] = {}
        for key_node, _value in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.get(key)
            except TypeError:  # an unhashable key: PyYAML's own error follows
                continue
            if first is not None:
                raise _DuplicateKey(None, None, f"`{key}` is given twice in one mapping (first on line "
                                    f"{first.start_mark.line + 1}); give each field once", key_node.start_mark)
            seen[key] = key_node
        return super().construct_mapping(node, deep=deep)


def recipe_from_yaml(text: str, *, source: Path | None = None) -> Recipe:
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except _DuplicateKey as exc:
        mark = exc.problem_mark
        raise RecipeError(f"{source or '<recipe>'}:{mark.line + 1}:{mark.column + 1}: {exc.problem}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f":{mark.line + 1}:{mark.column + 1}" if mark is not None else ""
        raise RecipeError(f"{source or '<recipe>'}{at}: malformed YAML ({getattr(exc, 'problem', exc)}); "
                          "fix the syntax there") from None
    return recipe_from_mapping(data, source=source)


def load_recipe(path: str | Path) -> Recipe:
    """Read and validate ``recipes/X.yaml``; profiles are loaded too, so a bad one fails here."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise RecipeError(f"cannot read recipe {str(p)!r} ({exc.strerror or exc}); see `prism recipe list`") from None
    recipe = recipe_from_yaml(text, source=p.resolve())
    from prism_plugin.cost.profiles import ProfileError, load_profile

    for emu in recipe.emulated:
        try:
            profile = load_profile(recipe.resolve_profile(emu))
        except ProfileError as exc:
            raise RecipeError(f"{p}: emulated[{emu.name}].profile: {exc}") from None
        if emu.device is DeviceMode.VIRTUAL_GPU and emu.gpu is None and profile.gpu is None:
            raise RecipeError(f"{p}: emulated[{emu.name}]: device virtual-gpu needs a GPU model: profile "
                              f"{profile.name!r} names none; use a GPU profile (dgx-h100) or set gpu: h100-sxm")
    return recipe
