"""How many GPUs: search a model over the GPU counts a cluster allows and say where scaling stops paying.

`plan --gpus auto` and `plan --gpus 8-512` answer the question people bring
before any layout question: the smallest count that fits, the best tokens/s
and tokens/s per GPU at each count, and the count past which another doubling
buys less than SCALING_WORTH_IT of its GPUs. Counts are powers of two within a
node, then whole nodes doubling from one (8, 16, 32, ... on 8-GPU nodes), the
sizes jobs are scheduled at; a range keeps those inside it.

`--gpus auto` stops AUTO_POINTS fitting counts past the smallest, or at the
first doubling that stops paying, so 405B on H100 answers in about a second:
infeasible counts are cheap (the search stops at the memory check of model
state), feasible ones cost one full search each.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from planner.figures import thousands

if TYPE_CHECKING:
    from planner.search.search import SearchResult
from topologies.cluster import MAX_WORLD_SIZE
from topologies.errors import UsageError

# A doubling "pays" when it gives at least this share of twice the throughput
# (80% scaling efficiency: the usual line below which a job is sized down).
SCALING_WORTH_IT = 0.8
AUTO_POINTS = 3  # fitting counts --gpus auto evaluates past the smallest one
AUTO_MAX_GPUS = 65536  # --gpus auto looks no further: a model that needs more is refused with this bound


@dataclass(frozen=True)
class GpuRange:
    """`--gpus` as typed: one count (lo == hi, not a sweep), a range lo-hi, or auto (1 up to AUTO_MAX_GPUS)."""

    lo: int
    hi: int
    auto: bool = False

    @property
    def is_sweep(self) -> bool:
        return self.auto or self.lo != self.hi


def parse_gpus(text: str) -> GpuRange:
    """'64' -> one count; '8-512' -> a range; 'auto' -> sweep. UsageError naming the value otherwise."""
    raw = str(text).strip().lower()
    if raw == "auto":
        return GpuRange(1, AUTO_MAX_GPUS, auto=True)
    match = re.fullmatch(r"(\d{1,9})(?:\s*-\s*(\d{1,9}))?", raw)
    if not match:
        raise UsageError(f"--gpus {text!r}: give a count (64), a range (8-512) or auto")
    lo = int(match.group(1))
    hi = int(match.group(2)) if match.group(2) else lo
    if lo < 1 or hi < lo:
        raise UsageError(f"--gpus {text!r}: counts start at 1 and a range goes low-high, e.g. 8-512")
    if hi > MAX_WORLD_SIZE:
        raise UsageError(f"--gpus {text!r}: {hi:,} exceeds the {MAX_WORLD_SIZE:,} GPUs meshplan models")
    return GpuRange(lo, hi)


def allowed_counts(gpus_per_node: int, lo: int, hi: int) -> list[int]:
    """Powers of two up to one node, then one node times powers of two, kept inside [lo, hi]."""
    counts = []
    n = 1
    while n < gpus_per_node:
        counts.append(n)
        n *= 2
    n = gpus_per_node
    while n <= min(hi, MAX_WORLD_SIZE):
        counts.append(n)
        n *= 2
    return [c for c in counts if lo <= c <= hi]


@dataclass(frozen=True)
class SweepPoint:
    gpus: int
    result: SearchResult

    @property
    def fits(self) -> bool:
        return bool(self.result.ranked)

    @property
    def tokens_per_s(self) -> float:
        return self.result.best.result.tokens_per_s if self.fits else 0.0

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.tokens_per_s / self.gpus

    def to_json(self) -> dict:
        if not self.fits:
            miss = self.result.near_miss
            return {"gpus": self.gpus, "fits": False,
                    "needed_bytes": miss.needed_bytes if miss else None}
        best = self.result.best
        return {"gpus": self.gpus, "fits": True, "tokens_per_s": self.tokens_per_s,
                "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu, "mfu": best.result.mfu,
                "step_time_s": best.result.step_time_s, "parallel": best.layout.to_json(),
                "global_batch_size": best.training.global_batch_size}


@dataclass(frozen=True)
class Sweep:
    points: tuple[SweepPoint, ...]
    elapsed_s: float
    stopped_paying_at: int | None  # the first count whose doubling stops paying (None: none did)
    ruled_out: tuple[int, ...] = ()  # counts skipped: model state alone cannot fit on them

    @property
    def smallest_fit(self) -> SweepPoint | None:
        return next((p for p in self.points if p.fits), None)

    @property
    def recommended(self) -> SweepPoint | None:
        """The fitting count with the most tokens/s per GPU: the fewest GPU-hours, so the lowest cost, per
        token at any price (cost = GPUs x hours, hours = tokens / tokens/s). More GPUs than this buy time
        with money; fewer cost more and take longer. The smallest count wins a tie."""
        fits = [p for p in self.points if p.fits]
        return max(fits, key=lambda p: p.tokens_per_s_per_gpu) if fits else None

    def to_json(self) -> dict:
        fit, best = self.smallest_fit, self.recommended
        return {"points": [p.to_json() for p in self.points], "smallest_fitting_gpus": fit.gpus if fit else None,
                "recommended_gpus": best.gpus if best else None,
                "scaling_stops_paying_after": self.stopped_paying_at, "ruled_out_by_model_state": list(self.ruled_out), "scaling_worth_it": SCALING_WORTH_IT,
                "elapsed_s": self.elapsed_s}


def sweep(counts: list[int], search_at: Callable[[int], SearchResult], auto: bool,
          state_bound: bool = True, max_fits: int = AUTO_POINTS + 1, budget_s: float | None = None) -> Sweep:
    """Search at each count in order; with `auto`, stop AUTO_POINTS fits past the first or when scaling stops paying.

    `search_at(n)` returns the search of n GPUs; a count the pins or batch rule
    out (a UsageError from the search) is skipped, not fatal. When model state
    alone did not fit on n GPUs (needing S per GPU against a capacity C), no
    count below n * S / C can fit either, since sharding divides the state at
    best linearly: those counts are skipped (`state_bound`; off when host
    offload changes what model state means).
    """
    started = time.perf_counter()
    points: list[SweepPoint] = []
    stopped: int | None = None
    fitting = 0
    at_least = 0.0
    skipped: list[int] = []
    for n in counts:
        if budget_s is not None and time.perf_counter() - started > budget_s:
            break
        if n < at_least and not fitting:
            skipped.append(n)
            continue
        try:
            result = search_at(n)
        except UsageError:
            continue
        point = SweepPoint(n, result)
        points.append(point)
        if not point.fits:
            miss = result.near_miss
            if state_bound and miss is not None and miss.what == "model state" and miss.capacity_bytes > 0:
                at_least = max(at_least, n * miss.needed_bytes / miss.capacity_bytes)
            continue
        fitting += 1
        previous = [p for p in points[:-1] if p.fits]
        if previous and stopped is None:
            before = previous[-1]
            gain = point.tokens_per_s / before.tokens_per_s
            if gain < SCALING_WORTH_IT * n / before.gpus:
                stopped = before.gpus
        if auto and (stopped is not None or fitting >= max_fits):
            break
    return Sweep(tuple(points), time.perf_counter() - started, stopped, tuple(skipped))


TOKEN_SUFFIXES = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12, "p": 1e15}


def parse_tokens(text: str) -> float:
    """'15T' -> 1.5e13 training tokens; positive and finite, else UsageError."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?(?:e\d+)?)\s*([kmbgtp]?)\s*", str(text).lower())
    if not match:
        raise UsageError(f"--tokens {text!r}: give a token count such as 15T, 2.5e12 or 300B")
    value = float(match.group(1)) * TOKEN_SUFFIXES[match.group(2)]
    if not 0 < value < 1e18:
        raise UsageError(f"--tokens {text!r}: give a positive count below 1e18")
    return value


def training_cost(tokens: float, tokens_per_s: float, gpus: int, price_per_gpu_hour: float | None) -> dict:
    """Days to train `tokens` at `tokens_per_s`, GPU-hours, and the cost when a price is given."""
    seconds = tokens / tokens_per_s
    gpu_hours = seconds / 3600 * gpus
    out = {"tokens": tokens, "days": seconds / 86400, "gpu_hours": gpu_hours}
    if price_per_gpu_hour is not None:
        out["cost"] = gpu_hours * price_per_gpu_hour
        out["price_per_gpu_hour"] = price_per_gpu_hour
    return out


def describe_cost(cost: dict, currency: str = "$") -> str:
    text = f"{cost['tokens'] / 1e12:.3g}T tokens take {thousands(cost['days'])} days ({thousands(cost['gpu_hours'])} " \
           "GPU-hours)"
    if "cost" in cost:
        text += f", {currency}{thousands(cost['cost'])} at {currency}{cost['price_per_gpu_hour']:g} per GPU-hour"
    return text
