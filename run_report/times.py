"""Times on the command line and in the outputs: RFC 3339 or Unix seconds in, RFC 3339 UTC out."""

from __future__ import annotations

import datetime
import re

_RELATIVE = re.compile(r"^now(?:-(\d+(?:\.\d+)?)([smhd]))?$")
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
# The Unix seconds a time can be: those of years 1 to 9999, what RFC 3339 writes (iso)
EARLIEST = datetime.datetime(1, 1, 1, tzinfo=datetime.timezone.utc).timestamp()
LATEST = datetime.datetime(9999, 12, 31, 23, 59, 59, tzinfo=datetime.timezone.utc).timestamp()
FORMS = "use RFC 3339 (2024-05-01T12:00:00Z), Unix seconds, now or now-2h"


def parse_time(text: str, now: float) -> float:
    """Unix seconds from `2024-05-01T12:00:00Z` (RFC 3339; no zone means UTC), `1714564800`, `now`
    or `now-2h`; ValueError with the accepted forms otherwise, and for a time outside years 1 to 9999
    (inf, nan, 1e20), which no window or output could hold."""
    seconds = _seconds(text.strip(), now)
    if not EARLIEST <= seconds <= LATEST:  # also false for nan
        hint = ""
        if LATEST < seconds <= LATEST * 1000:  # Grafana's URLs (from=, to=) carry Unix milliseconds
            hint = (f"; {text.strip()} looks like Unix milliseconds (Grafana's URLs): {seconds / 1000:.0f} is "
                    f"{iso(seconds / 1000)}")
        raise ValueError(f"cannot read time {text.strip()!r}: it must lie between {EARLIEST:.0f} "
                         f"({iso(EARLIEST)}) and {LATEST:.0f} ({iso(LATEST)}) in Unix seconds{hint}")
    return seconds


def _seconds(text: str, now: float) -> float:
    relative = _RELATIVE.match(text)
    if relative:
        amount, unit = relative.groups()
        return now - (float(amount) * _UNIT_SECONDS[unit] if amount else 0.0)
    try:
        return float(text)
    except ValueError:
        pass
    try:
        parsed = datetime.datetime.fromisoformat(text.replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        raise ValueError(f"cannot read time {text!r}: {FORMS}") from None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=datetime.timezone.utc)
    return parsed.timestamp()


def iso(seconds: float) -> str:
    """RFC 3339 in UTC with milliseconds: what the CSVs and the page show."""
    moment = datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def clock(seconds: float, start: float, end: float) -> str:
    """A time inside the window [start, end] in words: `04:35:00`, with its date where the window spans more than
    one UTC day (`2024-05-03 04:35:00`): on a week-long run a time of day alone does not say which day."""
    moment = iso(seconds)
    return moment[11:19] if iso(start)[:10] == iso(end)[:10] else f"{moment[:10]} {moment[11:19]}"
