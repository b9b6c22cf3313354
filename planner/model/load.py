"""Resolving --model: a preset name, a size alias (13B) or a path to a config file."""

from __future__ import annotations

import json
from pathlib import Path

from planner.model.hf_config import is_hf_config, model_from_hf_config
from planner.model.presets import PRESETS, SIZE_ALIASES, preset_names
from planner.model.spec import ModelSpec
from topologies.errors import ModelError, nearest
from topologies.files import read_text


def load_model(name_or_path: str) -> ModelSpec:
    """Resolve --model: a preset name, a size alias (13B) or a path to a JSON file.

    A JSON file may be a Hugging Face config.json or meshplan's own ModelSpec JSON.
    """
    key = name_or_path.strip()
    if key in PRESETS:
        return PRESETS[key]
    upper = key.upper()
    if upper in SIZE_ALIASES:
        return PRESETS[SIZE_ALIASES[upper]]
    if key.lower() in PRESETS:
        return PRESETS[key.lower()]
    path = Path(key)
    if path.is_dir() and (path / "config.json").is_file():  # a Hugging Face snapshot directory
        return _load_model_file(path / "config.json")
    if path.suffix == ".json" or path.exists():
        return _load_model_file(path)
    raise ModelError(
        f"unknown model {key!r}{nearest(key, preset_names())}: use a preset "
        f"({', '.join(preset_names())}), a size alias ({', '.join(SIZE_ALIASES)}) or a path to a config.json"
    )


def weights_dir(name_or_path: str) -> str | None:
    """The absolute Hugging Face directory behind --model when it holds safetensors weights, else None.

    `--model DIR` (or DIR/config.json) with model.safetensors, sharded files and
    their model.safetensors.index.json: the directory `execute --init-from` reads.
    """
    path = Path(name_or_path.strip()).expanduser()
    directory = path if path.is_dir() else path.parent if path.name == "config.json" and path.is_file() else None
    if directory is None or not (directory / "config.json").is_file():
        return None
    if (directory / "model.safetensors.index.json").is_file() or any(directory.glob("*.safetensors")):
        return str(directory.resolve())
    return None


def _load_model_file(path: Path) -> ModelSpec:
    text = read_text(path, "model file", "a Hugging Face config.json (or its directory) or a ModelSpec JSON",
                     ModelError)
    try:
        data = json.loads(text, parse_constant=_no_constant)
    except json.JSONDecodeError as exc:
        raise ModelError(f"model file {str(path)!r} is not valid JSON: {exc.msg} at line {exc.lineno}") from None
    except RecursionError:
        raise ModelError(f"model file {str(path)!r} nests too deeply to be a model config") from None
    except ValueError as exc:
        raise ModelError(f"model file {str(path)!r}: {exc}") from None
    if not isinstance(data, dict):
        raise ModelError(f"model file {str(path)!r} must hold a JSON object, got {type(data).__name__}")
    if is_hf_config(data):
        default = path.parent.name if path.name == "config.json" and path.parent.name else path.stem
        return model_from_hf_config(data, default_name=default, source=str(path))
    data.setdefault("name", path.stem)
    return ModelSpec.from_json(data)


def _no_constant(name: str) -> float:
    """json.loads would turn NaN and Infinity into floats that no model size can be."""
    raise ValueError(f"{name} is not a number a model config can hold")
