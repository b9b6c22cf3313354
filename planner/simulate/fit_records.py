"""Fit records of a calibration profile (CalibrationProfile.fits, written by bench/fit.py): fields by path.

A fitted field is named by its path in the profile: "gemm_efficiency", "link_efficiency.net",
"engine_factors.meshplan.attention_efficiency", "part_sm_rate.gb300".
"""

from __future__ import annotations

import json
import math
from typing import Any


def field_value(profile, path: str) -> Any:
    """A field of `profile` by path: "gemm_efficiency", "link_efficiency.net",
    "engine_factors.meshplan.attention_efficiency", "part_sm_rate.gb300"; None where a key is absent."""
    head, *keys = path.split(".")
    value: Any = getattr(profile, head)
    for key in keys:
        if not isinstance(value, dict):
            return None
        value = value.get(key)
    return value


def with_field(profile, path: str, value: Any) -> Any:
    """`profile` with the field at `path` (field_value's) set to `value`; other keys of a dict field kept."""
    head, *keys = path.split(".")
    if not keys:
        return profile.replace(**{head: value})
    top = json.loads(json.dumps(getattr(profile, head)))
    node = top
    for key in keys[:-1]:
        node = node.setdefault(key, {})
    node[keys[-1]] = value
    return profile.replace(**{head: top})


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
    return a == b


def holds(profile, record: dict[str, Any]) -> bool:
    """Whether `profile` still holds every value the fit `record` wrote."""
    return all(_same(field_value(profile, path), value) for path, value in record["fields"].items())
