"""Releases as changes: an engine at a release is its oldest modelled release with every change up to it.

Each engine module lists the releases it models, oldest first (what
`--engine NAME@LABEL` takes, each with the code it stands for), and what
changed in its stack between them: each change names the first of those
releases whose code contains it (checked against the stack's git history) and
its source (commit, pull request, release notes). `build_releases` applies them
in order, so an engine module reads as a changelog.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from planner.engines.base import Engine


@dataclass(frozen=True)
class Release:
    """A release the planner models: its label (--engine NAME@LABEL) and the code it stands for."""

    label: str
    summary: str


@dataclass(frozen=True)
class Change:
    """A change that moves a prediction: from release `since` on, the engine's `fields` hold these values."""

    since: str  # the label of the first modelled release that contains it
    source: str  # commit, pull request or release notes
    what: str
    fields: dict[str, Any]


def build_releases(base: Engine, releases: tuple[Release, ...], changes: tuple[Change, ...]) -> dict[str, Engine]:
    """{label: the engine at that release}, oldest first: `base` with every change since an earlier or this release."""
    order = {r.label: i for i, r in enumerate(releases)}
    unknown = [c.since for c in changes if c.since not in order]
    if unknown:
        raise ValueError(f"{base.name}: changes name releases it does not list: {unknown}")
    out: dict[str, Engine] = {}
    for i, release in enumerate(releases):
        fields: dict[str, Any] = {}
        for change in sorted(changes, key=lambda c: order[c.since]):
            if order[change.since] <= i:
                fields.update(change.fields)
        out[release.label] = dataclasses.replace(base, release=release.label, summary=release.summary, **fields)
    return out
