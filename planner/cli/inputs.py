"""What `plan` and `compare` read besides their flags: a --config file, a model directory, headroom.

`--config FILE` holds the same keys as the flags (`global-batch` or
`global_batch`), in TOML or YAML; flags typed on the command line win over it.
It is applied as click's `default_map`, so every value still goes through the
flag's own type and range check. A Hugging Face snapshot directory given to
--model means its config.json.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import click

from topologies.errors import UsageError, nearest
from topologies.files import read_text

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib


def _read_config(path: str) -> dict[str, Any]:
    p = Path(path)
    text = read_text(p, "--config", "a .toml or .yaml file")
    try:
        if p.suffix.lower() in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
        else:
            data = tomllib.loads(text)
    except RecursionError:
        raise UsageError(f"--config {path!r} is nested too deeply to read") from None
    except Exception as exc:  # yaml.YAMLError and tomllib.TOMLDecodeError: one line, the parser's reason
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UsageError(f"--config {path!r} is not valid {'YAML' if p.suffix.lower() in ('.yaml', '.yml') else 'TOML'}: "
                         f"{first}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UsageError(f"--config {path!r} must hold keys and values (model = \"70B\"), got a {type(data).__name__}")
    return data


def _scalar(key: str, value: Any, path: str) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        raise UsageError(f"--config {path!r}: {key} = {value!r} is not a finite number")
    if isinstance(value, str) and "\x00" in value:
        raise UsageError(f"--config {path!r}: {key} holds a NUL character")
    if isinstance(value, (dict, list)):
        raise UsageError(f"--config {path!r}: {key} must be a single value, got {type(value).__name__}")
    # every value as the command line would type it: the option's own type converts and checks it
    return None if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def apply_config(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """Eager callback of --config: the file's keys become the command's defaults (flags still win)."""
    if not value:
        return value
    data = _read_config(value)
    options = {p.name: p for p in ctx.command.params if p.name not in ("config", "help")}
    flag_names = {}
    for p in options.values():
        for opt in getattr(p, "opts", []):
            flag_names[opt.lstrip("-").replace("-", "_")] = p.name
        flag_names[p.name] = p.name
    defaults: dict[str, Any] = {}
    for key, raw in data.items():
        name = flag_names.get(str(key).replace("-", "_"))
        if name is None:
            keys = sorted({opt.lstrip("-") for p in options.values() for opt in getattr(p, "opts", [])
                           if opt.startswith("--")})
            raise UsageError(f"--config {value!r}: unknown key {key!r}{nearest(str(key), keys)}; keys are the flags "
                             f"of `{ctx.command_path}`: {', '.join(keys)}")
        if raw is None:  # `key: null` (YAML) leaves the flag at its default, as if the key were absent
            continue
        param_obj = options[name]
        if getattr(param_obj, "multiple", False):
            items = raw if isinstance(raw, list) else [raw]
            if name == "overrides" and isinstance(raw, dict):  # [set] table: nic_gbit_per_s = 200
                items = [f"{k}={_scalar(k, v, value)}" for k, v in raw.items()]
            defaults[name] = [_scalar(key, v, value) for v in items]
        elif isinstance(raw, list) and str(getattr(param_obj, "metavar", "") or "").endswith(",..."):
            defaults[name] = ",".join(str(_scalar(key, v, value)) for v in raw)  # a comma-separated flag
        else:
            defaults[name] = _scalar(key, raw, value)
    ctx.default_map = {**(ctx.default_map or {}), **defaults}
    return value


config_option = click.option(
    "--config", type=click.Path(dir_okay=False), default=None, is_eager=True, expose_value=False,
    callback=apply_config,
    help="TOML or YAML file with the same keys as the flags (e.g. model = \"70B\", gpus = 64); flags win over it.")


def resolve_model_arg(name: str) -> str:
    """A Hugging Face snapshot directory -> its config.json; anything else unchanged.

    The model's name inside the file (`_name_or_path`) is the loader's
    business; the directory's own name is what a user typed, so it is kept in
    the error when the directory holds no config.json.
    """
    path = Path(name).expanduser()
    if not path.is_dir():
        return name
    config = path / "config.json"
    if not config.is_file():
        raise UsageError(f"--model {name!r} is a directory without config.json: give a Hugging Face snapshot "
                         "directory, a config.json path, or a preset name (`meshplan models`)")
    return str(config)


def load_model_arg(name: str):
    """--model resolved (snapshot directory -> config.json) and loaded; a malformed file is a ModelError, exit 2.

    The loader names the key for the values it checks; a value of a type or
    range it does not check (a list where a count belongs, 1e400, NaN) raises
    a Python error while it converts, which is still the file's fault: this
    turns it into one line naming the file instead of a traceback.
    """
    from planner.model.load import load_model
    from topologies.errors import ModelError

    path = resolve_model_arg(name)
    try:
        return _named_by_directory(load_model(path), path)
    except (TypeError, ValueError, OverflowError, ZeroDivisionError, AttributeError, KeyError) as exc:
        raise ModelError(f"model file {path!r} holds a value of the wrong type or range ({type(exc).__name__}: "
                         f"{exc}); fix that value or start from `meshplan models show NAME --json`") from None
    except RecursionError:
        raise ModelError(f"model file {path!r} is nested too deeply to be a model config") from None


def _named_by_directory(model, path: str):
    """A Hugging Face config.json without `_name_or_path` is named by its directory (Llama-3.1-8B), not 'llama'."""
    import dataclasses
    import json

    p = Path(path)
    if p.name != "config.json" or not p.is_file():
        return model
    try:
        data = json.loads(p.read_text())
    except (OSError, ValueError, RecursionError):
        return model
    if not isinstance(data, dict) or data.get("_name_or_path") or "name" in data:  # named, or a ModelSpec JSON
        return model
    directory = p.resolve().parent.name
    return dataclasses.replace(model, name=directory) if directory else model


def headroom_fraction(headroom_pct: float | None) -> float:
    """--memory-headroom PCT -> the usable share of GPU memory (the search's default when not given)."""
    from planner.search.search import USABLE_MEMORY_FRACTION

    if headroom_pct is None:
        return USABLE_MEMORY_FRACTION
    if not math.isfinite(headroom_pct) or not 0 <= headroom_pct < 90:
        raise UsageError(f"--memory-headroom {headroom_pct!r}: give a percentage from 0 to 90 (default 5)")
    return 1 - headroom_pct / 100


class FiniteFloat(click.ParamType):
    """A float flag that refuses NaN and infinity (click's FLOAT accepts both, and NaN passes every range)."""

    name = "number"

    def __init__(self, min_value: float | None = None, max_value: float | None = None) -> None:
        self.min_value, self.max_value = min_value, max_value

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        try:
            number = float(value)
        except (TypeError, ValueError, OverflowError):
            self.fail(f"{value!r} is not a number", param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        if self.min_value is not None and number < self.min_value:
            self.fail(f"{value!r} is below {self.min_value:g}", param, ctx)
        if self.max_value is not None and number > self.max_value:
            self.fail(f"{value!r} is above {self.max_value:g}", param, ctx)
        return number
