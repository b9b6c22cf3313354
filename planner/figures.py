"""Printed figures with the precision they deserve.

A step-time prediction is good to a few percent at best (the accuracy benches measure 3-16%
error, planner.accuracy), so printing 11.632 s claims two digits the model does not have.
Tables and sentences print predictions with three significant digits (11.6 s, 90.1k
tokens/s, 49.6%); JSON keeps full precision for scripts.
"""

from __future__ import annotations

import math

SIGNIFICANT = 3


def sig(value: float, digits: int = SIGNIFICANT) -> str:
    """`value` rounded to `digits` significant digits in plain notation: 11.632 -> '11.6',
    38321 -> '38300', 0.004512 -> '0.00451' (trailing zeros kept: 12.0 says three digits)."""
    if value == 0 or not math.isfinite(value):
        return f"{value:g}"
    decimals = digits - 1 - math.floor(math.log10(abs(value)))
    rounded = round(value, decimals)
    if rounded and math.floor(math.log10(abs(rounded))) != math.floor(math.log10(abs(value))):
        decimals -= 1  # 9.996 rounds to 10.0: one digit more before the point, one fewer after
        rounded = round(value, decimals)
    return f"{rounded:.{max(decimals, 0)}f}"


def percent(share: float, digits: int = SIGNIFICANT) -> str:
    """A share (0.496) as '49.6%'."""
    return sig(100.0 * share, digits) + "%"


def thousands(value: float, digits: int = SIGNIFICANT) -> str:
    """A large count with thousands separators after rounding: 90146 -> '90,100'."""
    text = sig(value, digits)
    if "." in text or abs(value) < 1000:
        return text
    return f"{int(text):,}"


def seconds(value_s: float) -> str:
    """A duration at three significant digits in the unit that reads best: '11.6 s', '590 ms', '45.2 us'."""
    for scale, unit in ((1.0, "s"), (1e-3, "ms"), (1e-6, "us")):
        if abs(value_s) >= scale:
            return f"{sig(value_s / scale)} {unit}"
    return f"{sig(value_s / 1e-9)} ns" if value_s else "0 s"
