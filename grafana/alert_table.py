"""The alert table of docs/alerts.md ("The alerts"), written from grafana/docs/alert-table.md between two markers.

The source spells each threshold as the rule sources do (`<<percent:NAME>>`, `<<threshold:NAME>>`, see
grafana/rules/render.py), a threshold in minutes or hours as `<<minutes:NAME>>` / `<<hours:NAME>>`, and an alert's
`for` as `<<for:ALERT>>`, read from the rendered rules: a threshold changed in stepscope_contract, or a `for`
changed in a rule source, reaches the page with `python -m grafana generate` instead of leaving it behind.
Every alert of the rules has one row and every row is an alert's, or generate refuses.
"""

import re
from collections.abc import Mapping

import yaml

from grafana.rules import render
from stepscope.contract import THRESHOLDS

SOURCE = "grafana/docs/alert-table.md"
BEGIN = "<!-- generated: alert table (python -m grafana generate from grafana/docs/alert-table.md) -->"
END = "<!-- /generated: alert table -->"
ROW_ALERT = re.compile(r'^\| <a id="[a-z]+"></a>`(Stepscope\w+)`', re.M)


class TableError(ValueError):
    """The source names an alert, threshold or placeholder the rules and contract lack: one line."""


def alert_durations(rule_files: Mapping[str, str]) -> dict[str, str]:
    """Each alert of the rendered rule files -> its `for` as written there ("0s" where it has none)."""
    return {rule["alert"]: rule.get("for", "0s") for text in rule_files.values()
            for group in yaml.safe_load(text)["groups"] for rule in group["rules"] if "alert" in rule}


def _in_unit(name: str, seconds_per_unit: int) -> str:
    return f"{THRESHOLDS[name].value / seconds_per_unit:g}"


def _fill_doc_kinds(source: str, durations: Mapping[str, str]) -> str:
    """The kinds only the page has: `for`, and thresholds in minutes or hours."""
    kinds = {"for": durations.__getitem__, "minutes": lambda name: _in_unit(name, 60),
             "hours": lambda name: _in_unit(name, 3600)}

    def fill(match: re.Match[str]) -> str:
        kind, name = match.groups()
        try:
            return kinds[kind](name)
        except KeyError:
            line = source.count("\n", 0, match.start()) + 1
            raise TableError(f"{SOURCE}:{line}: unknown placeholder {match.group(0)} (an alert of the rules, or a "
                             "threshold of stepscope_contract)") from None

    return render.PLACEHOLDER.sub(lambda m: fill(m) if m.group(1) in kinds else m.group(0), source)


def table(source: str, rule_files: Mapping[str, str]) -> str:
    """The table's Markdown: `source` with its placeholders filled; TableError when its rows and the alerts differ."""
    durations = alert_durations(rule_files)
    rows = ROW_ALERT.findall(source)
    if missing := sorted(set(durations) - set(rows)):
        raise TableError(f"{SOURCE}: no row for the alert(s) {', '.join(missing)}")
    if unknown := sorted({row for row in rows if row not in durations} | {r for r in rows if rows.count(r) > 1}):
        raise TableError(f"{SOURCE}: rows for no alert of the rules, or twice: {', '.join(unknown)}")
    try:
        return render.fill_placeholders(_fill_doc_kinds(source, durations), SOURCE)
    except render.UnknownPlaceholder as error:
        raise TableError(str(error)) from None


def rewrite(text: str, source: str, rule_files: Mapping[str, str]) -> str:
    """The page's text with the block between the markers replaced by the current table."""
    if BEGIN not in text or END not in text:
        raise TableError(f"docs/alerts.md lacks the markers {BEGIN!r} ... {END!r}")
    head, rest = text.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    return f"{head}{BEGIN}\n{table(source, rule_files)}{END}{tail}"
