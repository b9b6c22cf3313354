"""A small TOML writer: tables of scalars and (nested) lists, with comments.

Python reads TOML (tomllib) but does not write it, and a config of a dozen
keys does not justify a dependency. This writes the subset TOML 1.0 needs for
job configs: `[table]` headers, bare or quoted keys, basic strings, integers,
finite floats, booleans, and arrays of those (arrays may nest). Everything
else is refused, so what we write always parses back to what we meant.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from topologies.errors import UsageError

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")  # fullmatch: "$" would also match before a final newline
_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def _key(key: str) -> str:
    return key if _BARE_KEY.fullmatch(key) else _string(key)


def _string(text: str) -> str:
    out = []
    for ch in text:
        if ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04X}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _one_line(text: str) -> str:
    """Comments end at a newline, so a comment's own newlines become spaces."""
    return " ".join(text.splitlines())


def value(v: Any) -> str:
    """One TOML value. bool is checked before int because bool is an int in Python."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            raise UsageError(f"TOML export: refusing the non-finite float {v!r}")
        return repr(v)
    if isinstance(v, str):
        return _string(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(value(item) for item in v) + "]"
    raise UsageError(f"TOML export: cannot write a {type(v).__name__} ({v!r})")


def dumps(tables: Mapping[str | tuple[str, ...], Mapping[str, Any]], header: Sequence[str] = (),
          comments: Mapping[tuple[str, str], str] | None = None) -> str:
    """Render `{table: {key: value}}` as TOML.

    `header` lines become comments at the top; `comments[(table, key)]`
    becomes a trailing comment on that key's line. A table named by a tuple
    of keys (("quantize", "linear", "float8")) is that nested table.
    """
    comments = comments or {}
    out = [f"# {_one_line(line)}".rstrip() for line in header]
    for table, entries in tables.items():
        if out:
            out.append("")
        path = table if isinstance(table, tuple) else (table,)
        out.append(f"[{'.'.join(_key(part) for part in path)}]")
        for key, v in entries.items():
            line = f"{_key(key)} = {value(v)}"
            note = comments.get((table, key))
            if note:
                line += f"  # {_one_line(note)}"
            out.append(line)
    return "\n".join(out) + "\n"
