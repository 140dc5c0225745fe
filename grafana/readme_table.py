"""The metric table of docs/exporter.md ("What it publishes"), written from the contract between two markers.

Neighbouring families that share type, labels and meaning become one row, as a reader scans them.
"""

import itertools
from collections.abc import Iterable

from stepscope.contract import FAMILIES, Family

BEGIN = "<!-- generated: metric table (python -m grafana generate) -->"
END = "<!-- /generated: metric table -->"
HEADER = "| metric | labels | type | meaning |\n|---|---|---|---|\n"


def _labels(spec: Family) -> str:
    cells = [f"`{label}`" + (f" ({spec.label_notes[label]})" if label in spec.label_notes else "")
             for label in spec.labels]
    cells += [f"`{label}` (optional)" for label in spec.optional]
    return ", ".join(cells)


def _type(spec: Family) -> str:
    return {"info": f"{spec.type} (1)", "state set": f"{spec.type} (state set)"}.get(spec.kind, spec.type)


def rows(families: Iterable[Family]) -> str:
    lines = []
    for (labels, type_, doc), group in itertools.groupby(families, lambda f: (_labels(f), _type(f), f.doc)):
        names = ", ".join(f"`{spec.name}`" for spec in group)
        label_cell = f" {labels} " if labels else " "
        lines.append(f"| {names} |{label_cell}| {type_} | {doc} |")
    return "\n".join(lines) + "\n"


def table() -> str:
    return HEADER + rows(FAMILIES.values())


def rewrite(text: str) -> str:
    """The page's text with the block between the markers replaced by the current table."""
    if BEGIN not in text or END not in text:
        raise ValueError(f"docs/exporter.md lacks the markers {BEGIN!r} ... {END!r}")
    head, rest = text.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    return f"{head}{BEGIN}\n{table()}{END}{tail}"
