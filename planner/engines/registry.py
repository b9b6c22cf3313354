"""The engines by name and release: `--engine NAME[@RELEASE]`, a bare name being the newest release modelled."""

from __future__ import annotations

from planner.engines import deepspeed, megatron, meshplan, torchtitan
from planner.engines.base import Engine
from topologies.errors import PlanError

ENGINES: dict[str, dict[str, Engine]] = {
    "meshplan": meshplan.RELEASES,
    "megatron": megatron.RELEASES,
    "torchtitan": torchtitan.RELEASES,
    "deepspeed": deepspeed.RELEASES,
}
ENGINE_NAMES = tuple(ENGINES)
# every accepted --engine value: bare names, then NAME@RELEASE for every release modelled
ENGINE_CHOICES = ENGINE_NAMES + tuple(e.label for releases in ENGINES.values() for e in releases.values())
_RESOLVED: dict[str, Engine] = {}


def newest(name: str) -> Engine:
    """The newest release modelled of engine `name`."""
    return list(ENGINES[name].values())[-1]


def get_engine(spec: str | Engine) -> Engine:
    """The engine `spec` names (NAME or NAME@RELEASE; an Engine is returned as it is); a PlanError naming the
    choices otherwise."""
    if isinstance(spec, Engine):
        return spec
    hit = _RESOLVED.get(spec) if isinstance(spec, str) else None
    if hit is not None:
        return hit
    name, _, release = spec.partition("@") if isinstance(spec, str) else (spec, "", "")
    if name not in ENGINES:
        raise PlanError(f"engine must be one of {ENGINE_NAMES} (optionally NAME@RELEASE), got {spec!r}")
    releases = ENGINES[name]
    if release and release not in releases:
        raise PlanError(f"engine {name} has no release {release!r} modelled; releases: {', '.join(releases)} "
                        f"(a bare --engine {name} is the newest, {newest(name).release})")
    engine = releases[release] if release else newest(name)
    _RESOLVED[spec] = engine
    return engine


def engine_name(spec: str | Engine) -> str:
    """The stack's name without the release: what calibration profiles key their engine factors by."""
    return get_engine(spec).name


def releases_help() -> str:
    """One line per engine: its releases, newest last, for --help."""
    return "; ".join(f"{name}@{'|'.join(releases)}" for name, releases in ENGINES.items())
