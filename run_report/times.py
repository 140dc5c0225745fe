"""Times on the command line and in the outputs: RFC 3339 or Unix seconds in, RFC 3339 UTC out."""

from __future__ import annotations

import datetime
import re

_RELATIVE = re.compile(r"^now(?:-(\d+(?:\.\d+)?)([smhd]))?$")
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_time(text: str, now: float) -> float:
    """Unix seconds from `2024-05-01T12:00:00Z` (RFC 3339; no zone means UTC), `1714564800`, `now`
    or `now-2h`; ValueError with the accepted forms otherwise."""
    text = text.strip()
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
        raise ValueError(
            f"cannot read time {text!r}: use RFC 3339 (2024-05-01T12:00:00Z), Unix seconds, now or now-2h"
        ) from None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=datetime.timezone.utc)
    return parsed.timestamp()


def iso(seconds: float) -> str:
    """RFC 3339 in UTC with milliseconds: what the CSVs and the page show."""
    moment = datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")
