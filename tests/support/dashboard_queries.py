"""Every PromQL query of the generated dashboards (grafana/dashboards_out), with template variables filled in as `.*`.

The end-to-end test runs these against a real Prometheus; the dashboard tests parse them with
promtool. Multi-value variables are matched with `=~`, so the regex `.*` selects everything; single-value ones
exactly (`=`), turned into `=~".*"` here. `grafana_interpolate` fills them in as Grafana does instead.
"""

import json
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

DASHBOARDS_DIR = Path(__file__).resolve().parents[2] / "grafana" / "dashboards_out"
# A variable's name starts with a letter or _: `$1` is a regex group in label_replace's replacement, which Grafana
# leaves as it is (no variable has that name).
VARIABLE = re.compile(r"\$\{([A-Za-z_]\w*)(?::\w+)?\}|\$([A-Za-z_]\w*)")
EXACT_MATCHER = re.compile(r'(\w+)="\$\{?(\w+)\}?"')
LABEL_VALUES = re.compile(r"^label_values\((?:(.*),\s*)?(\w+)\)$", re.DOTALL)
# Grafana's built-in interval variables, for a query run outside Grafana.
BUILTINS = {"__rate_interval": "1m", "__interval": "1m", "__range": "1h"}


@dataclass(frozen=True)
class PanelQuery:
    dashboard: str
    panel: str
    ref_id: str
    expr: str
    raw_expr: str


@dataclass(frozen=True)
class VariableQuery:
    dashboard: str
    variable: str
    selector: str
    label: str
    raw_query: str


def substitute(text: str) -> str:
    """Replaces $var and ${var}: built-ins with fixed windows, a fixed list's variable (`custom`, such as how many
    ranks to draw) with the value it starts at, the dashboard's query variables with `.*`; a label matched exactly
    to a variable (`run="$run"`, a single-value one) is matched to `.*` as a regex, every value."""
    fixed = {**BUILTINS, **custom_defaults()}

    def every_value(match: re.Match) -> str:
        return match.group(0) if match.group(2) in fixed else f'{match.group(1)}=~".*"'

    def replace(match: re.Match) -> str:
        return fixed.get(match.group(1) or match.group(2), ".*")

    return VARIABLE.sub(replace, EXACT_MATCHER.sub(every_value, text))


def grafana_interpolate(expr: str, model: dict, values: dict[str, str | list[str]]) -> str:
    """`expr` as Grafana's Prometheus data source sends it with the dashboard's variables at `values`
    (PrometheusDatasource.interpolateQueryExpr): a variable that takes one value only, neither multi nor with an
    "All", is written as it is, regex characters included (only backslash and single quote escaped); a multi or
    include-all one has each value regex-escaped for a PromQL string, several joined as (a|b), and "$__all" is its
    custom all value, unescaped."""
    variables = {variable["name"]: variable for variable in model["templating"]["list"]}

    def regex_escaped(value: str) -> str:
        return re.sub(r"[$^*{}\[\]'+?.()|]", lambda m: "\\\\" + m.group(0), value.replace("\\", "\\\\\\\\"))

    def replace(match: re.Match) -> str:
        name = match.group(1) or match.group(2)
        value, variable = values[name], variables[name]
        if value == "$__all" and variable.get("allValue"):
            return variable["allValue"]
        if not (variable.get("multi") or variable.get("includeAll")):
            return str(value).replace("\\", "\\\\").replace("'", "\\\\'")
        escaped = [regex_escaped(item) for item in ([value] if isinstance(value, str) else value)]
        return escaped[0] if len(escaped) == 1 else "(" + "|".join(escaped) + ")"

    return VARIABLE.sub(replace, expr)


@cache
def custom_defaults(directory: Path = DASHBOARDS_DIR) -> dict[str, str]:
    """{name: the value it starts at} of every dashboard's `custom` variables (their names are the dashboards')."""
    return {variable["name"]: variable["current"]["value"]
            for model in load_dashboards(directory).values()
            for variable in model.get("templating", {}).get("list", []) if variable.get("type") == "custom"}


def load_dashboards(directory: Path = DASHBOARDS_DIR) -> dict[str, dict]:
    """{file name: dashboard model} for every committed dashboard JSON."""
    return {path.name: json.loads(path.read_text()) for path in sorted(directory.glob("*.json"))}


def panels(model: dict) -> list[dict]:
    """Every panel that is not a row, including panels nested in collapsed rows."""
    found = []
    for panel in model.get("panels", []):
        if panel.get("type") == "row":
            found.extend(panel.get("panels", []))
        else:
            found.append(panel)
    return found


# Queries (dashboard, panel, ref_id) that return nothing while a run has no more ranks than 'Ranks drawn' (5): the
# state timeline's row of the ranks it hides (tests/test_dashboards.py draws it for 64 ranks).
EMPTY_WHILE_ALL_DRAWN = {("stepscope-training.json", "Training state per rank", "B")}


def panel_queries(directory: Path = DASHBOARDS_DIR) -> list[PanelQuery]:
    return [
        PanelQuery(name, panel["title"], target.get("refId", ""), substitute(target["expr"]), target["expr"])
        for name, model in load_dashboards(directory).items()
        for panel in panels(model)
        for target in panel.get("targets", [])
        if "expr" in target
    ]


def variable_queries(directory: Path = DASHBOARDS_DIR) -> list[VariableQuery]:
    """`label_values(selector, label)` variables; the selector is a PromQL series selector."""
    found = []
    for name, model in load_dashboards(directory).items():
        for variable in model.get("templating", {}).get("list", []):
            if variable.get("type") != "query":
                continue
            query = variable["query"] if isinstance(variable["query"], str) else variable["query"]["query"]
            match = LABEL_VALUES.match(query.strip())
            if match is None:
                raise ValueError(f"{name}: variable {variable['name']} is not label_values(...): {query}")
            found.append(
                VariableQuery(
                    name, variable["name"], substitute(match.group(1) or ""), match.group(2), query
                )
            )
    return found
