"""Numbers in words for the page and the verdict: milliseconds below a second, percentages, counts."""

from __future__ import annotations


def seconds(value: float | None) -> str:
    """Three significant digits, whole seconds from 1,000 s on: a rank's 10,140 s in train read "1.01e+04 s"."""
    if value is None:
        return "no data"
    if abs(value) < 1:
        return f"{value * 1000:.3g} ms"
    return f"{value:.3g} s" if abs(value) < 1000 else f"{value:,.0f} s"


def percent(value: float | None) -> str:
    return "no data" if value is None else f"{value:.0%}"


def count(value: float | None) -> str:
    return "no data" if value is None else f"{value:,.0f}"


def activity(value: float | None) -> str:
    """A 0-1 activity (SM active, tensor cores) in two decimals; below 0.01 one significant digit, since a
    GPU whose SMs are active 0.0009 of the time is not 0."""
    if value is None:
        return "not read"
    return f"{value:.2f}" if value >= 0.01 else f"{value:.1g}"


def gibibytes(value: float | None) -> str:
    return "no data" if value is None else f"{value / 2**30:.3g} GiB"


def score(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}"


def duration(total_seconds: float) -> str:
    hours, rest = divmod(round(total_seconds), 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h {minutes:02d}m {secs:02d}s" if hours else f"{minutes}m {secs:02d}s"
