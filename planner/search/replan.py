"""Re-plan a running job for the GPUs it has now: a node lost (or back), in one step.

`meshplan execute PLAN --resume --replan` (and, with --max-restarts, every
worker group torchrun starts with another number of ranks) calls `replan`:
the same model, sequence length, global batch, engine, precision and recipe
as PLAN, searched by planner.search as `meshplan plan` does, on PLAN's
cluster resized to the nodes x GPUs present. The options `plan` was given
(plan.json "search": pins, memory headroom, calibration) are pinned again
where they still hold on the new count: a degree pin (tp, pp, dp, dp_shard,
cp, ep, etp) that does not divide it is dropped, with the rest kept. The new
plan records the original pins, so when the GPUs come back the next re-plan
restores them. The executor then resumes the newest valid checkpoint
resharded (checkpoints are keyed by parameter names, not by layout).

No torch here: the launcher re-plans before any rank starts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from planner.plan import Plan
from planner.search.candidates import Pins, check_pins
from topologies.errors import MeshplanError, UsageError

DEGREE_PINS = ("tp", "pp", "dp", "dp_shard", "cp", "ep", "etp", "virtual_stages")


@dataclass(frozen=True)
class Replan:
    old: Plan
    new: Plan
    kept: Pins
    dropped: dict[str, object]  # pins that no longer hold on the new count

    def lines(self) -> list[str]:
        """What the user sees: the old and the new layout with their predicted step times, and the pins."""
        from planner.search.explain import short

        o, n = self.old, self.new
        out = [f"replan: {o.world_size} ranks planned ({_shape(o)}), {n.world_size} present ({_shape(n)}): "
               f"{n.model.name}, seq {n.training.seq_len}, global batch {n.training.global_batch_size}, "
               f"engine {n.engine}",
               f"  was: {short(o.layout)}{_predicted(o)}",
               f"  now: {short(n.layout)}{_predicted(n)}"]
        kept = ", ".join(f"{k}={v}" for k, v in self.kept.pinned().items())
        if kept or self.dropped:
            out.append(f"  pins kept: {kept or 'none'}"
                       + (f"; dropped (no longer valid): {', '.join(f'{k}={v}' for k, v in self.dropped.items())}"
                          if self.dropped else ""))
        return out


def _shape(plan: Plan) -> str:
    c = plan.cluster
    return f"{c.n_nodes} node{'s' if c.n_nodes > 1 else ''} x {c.gpus_per_node}"


def _predicted(plan: Plan) -> str:
    if plan.prediction is None:
        return ""
    p = plan.prediction
    peak = p.peak_memory_bytes
    memory = f"{peak / 2**30:.1f} GiB" if peak >= 2**30 else f"{peak / 2**20:.1f} MiB"
    return f"   predicted {p.step_time_s:.4g} s/step, {p.tokens_per_s:,.0f} tokens/s, {memory} per GPU"


def replan(plan: Plan, n_nodes: int, gpus_per_node: int) -> Replan:
    """The best plan for n_nodes x gpus_per_node (see the module docstring); typed errors when none fits."""
    from planner.search.explain import build_plan, no_layout_error
    from planner.search.search import USABLE_MEMORY_FRACTION, search
    from planner.simulate.calibration import load_calibration
    from planner.training import RECIPE_KEYS

    cluster = plan.cluster.with_nodes(n_nodes, gpus_per_node)
    searched = plan.search or {}
    original = Pins.from_json(searched.get("pins") or {})
    fraction = float(searched.get("usable_memory_fraction") or USABLE_MEMORY_FRACTION)
    calibration = load_calibration(searched.get("calibration"), cluster.gpu)
    t = plan.training
    default = type(t)(seq_len=t.seq_len, global_batch_size=t.global_batch_size)
    recipe = {k: getattr(t, k) for k in RECIPE_KEYS if getattr(t, k) != getattr(default, k)}
    failure: MeshplanError | None = None
    for pins, dropped in _pin_choices(original, plan, cluster.world_size):
        result = search(plan.model, cluster, t.seq_len, t.global_batch_size, pins, plan.engine, calibration,
                        usable_memory_fraction=fraction, precision=t.precision, attention=t.attention,
                        compile=t.compile, async_tp=t.async_tp, recipe=recipe)
        if result.ranked:
            new = dataclasses.replace(build_plan(plan.model, cluster, result, plan.engine),
                                      search={**searched, "pins": original.to_json()},
                                      weights_dir=getattr(plan, "weights_dir", None))
            return Replan(plan, new, pins, dropped)
        failure = no_layout_error(result, pins, cluster.world_size, plan.engine)
    raise failure


def _pin_choices(pins: Pins, plan: Plan, n_gpus: int):
    """(pins, dropped) to try, most faithful first: all pins; then without dp/dp_shard; then without every degree
    pin. Pins that check_pins refuses on n_gpus are skipped; when none is left, its last error is raised."""
    t = plan.training
    degree = {k: v for k, v in pins.pinned().items() if k in DEGREE_PINS}
    tried: list[Pins] = []
    error: UsageError | None = None
    for drop in (set(), {"dp", "dp_shard"} & set(degree), set(degree)):
        try:
            kept = dataclasses.replace(pins, **{k: None for k in drop})
            check_pins(n_gpus, plan.model, t.seq_len, t.global_batch_size, kept)
        except UsageError as exc:  # refused on n_gpus, or contradictory without the dropped ones
            error = exc
            continue
        if kept not in tried:
            tried.append(kept)
            yield kept, {k: v for k, v in degree.items() if k in drop}
    if not tried:
        raise error
