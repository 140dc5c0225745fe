"""The Go GC target the deployments give Prometheus, read from the compose stack where it is set, so
that the scale benchmark measures Prometheus as users run it and the chart's default can be held to it."""

import re
from pathlib import Path

import yaml

COMPOSE = Path(__file__).resolve().parents[1] / "docker" / "compose.yaml"
GOGC_SETTING = re.compile(r"\$\{PROMETHEUS_GOGC:-(?P<default>[0-9]+)\}")


def compose_prometheus_gogc() -> int:
    """The GOGC default of the compose stack's Prometheus (`${PROMETHEUS_GOGC:-N}`)."""
    setting = yaml.safe_load(COMPOSE.read_text())["services"]["prometheus"]["environment"]["GOGC"]
    match = GOGC_SETTING.fullmatch(str(setting))
    if match is None:
        raise ValueError(f"{COMPOSE}: prometheus GOGC is {setting!r}, not ${{PROMETHEUS_GOGC:-N}}")
    return int(match["default"])
