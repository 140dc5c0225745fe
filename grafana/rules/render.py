"""A rules source -> the rule file Prometheus loads: contract names filled in where the source says
`<<kind:NAME>>`, so a rename in stepscope_contract reaches the rules with `python -m grafana generate`.

    <<family:STEPS_TOTAL>>             stepscope.contract.families.STEPS_TOTAL (add _bucket etc. after it)
    <<record:RUN_VERDICT>>             stepscope.contract.recordings.RUN_VERDICT
    <<threshold:data_loading_share>>   THRESHOLDS["data_loading_share"] as a number (0.3)
    <<percent:data_loading_share>>     the same as a share (30%), for annotations
    <<phase:DATA_LOADING_PHASE>>       a phase constant of stepscope.contract.training
    <<phases:LOCAL_PHASES>>            a tuple of phases as a regex alternation (a|b|c)
    <<state:TRAIN_STATE>>              a state constant of stepscope.contract.training
    <<timing:HOST_TIMING>>             a `timing` value of stepscope.contract.training
    <<timings:GPU_TIMINGS>>            a tuple of `timing` values as a regex alternation
    <<verdict:DATA_BOUND>>             a verdict of stepscope.contract.verdicts
    <<peak_flops:BF16>>                the peak FLOP/s table for a dtype of stepscope.contract.peak_flops
                                       (several lines, each indented as the placeholder's line)
    <<rule:RUN_IN_BREAK>>              the expression of the recording <<record:RUN_IN_BREAK>> of the same
                                       source file (its own <<rule:...>> filled in), in parentheses: a rule
                                       that needs another's value in the same evaluation computes it itself
                                       rather than read it one level up (on VictoriaMetrics each level of
                                       new series costs ~10 s, docs/engines.md), without a second copy of it
                                       in the source; in a block scalar (`expr: |`), as it spans lines

The `<<` `>>` brackets never clash with the `{{ $value }}` templates of alert annotations.

After the placeholders, `held(SELECTOR)` or `held(SELECTOR offset D)` becomes the selector, or where its
target's latest scrape failed or its exporter started less than SETTLE_SECONDS before, its last value
from the last HOLD_SECONDS (stepscope_contract/scrape_gaps.py says why): a scrape gap then changes no
alert. The selector keeps its `instance` and `job` labels for that (read it inside any aggregation).
"""

import re
from collections.abc import Callable

import yaml

from stepscope.contract import THRESHOLDS, families, peak_flops, recordings, training, verdicts
from stepscope.contract.scrape_gaps import HOLD_SECONDS, SETTLE_SECONDS

PLACEHOLDER = re.compile(r"<<(\w+):(\w+)>>")
RULE = re.compile(r"<<rule:(\w+)>>")
HELD_CALL = re.compile(r"\bheld\(")
HELD = re.compile(r"held\(\s*(?P<selector>[A-Za-z_:][\w:]*(?:\{[^{}]*\})?|\{[^{}]*\})"
                  r"(?:\s+offset\s+(?P<offset>\d+)(?P<unit>[sm]))?\s*\)")


class UnknownPlaceholder(ValueError):
    """A placeholder whose kind or name the contract does not have: one line, with file and line."""


def _named(module: object, suffix: str = "", kind: type = str) -> Callable[[str], str]:
    """An upper-case constant of `module` ending in `suffix`: a string as it is, a tuple as a|b|c."""
    def value(name: str) -> str:
        found = getattr(module, name, None)
        if not (name.isupper() and name.endswith(suffix) and isinstance(found, kind)):
            raise KeyError(name)
        return found if isinstance(found, str) else "|".join(found)
    return value


KINDS: dict[str, Callable[[str], str]] = {
    "family": _named(families),
    "record": _named(recordings),
    "threshold": lambda name: THRESHOLDS[name].number,
    "percent": lambda name: THRESHOLDS[name].percent,
    "phase": _named(training, "_PHASE"),
    "phases": _named(training, "PHASES", tuple),
    "state": _named(training, "_STATE"),
    "timing": _named(training, "_TIMING"),
    "timings": _named(training, "TIMINGS", tuple),
    "verdict": _named(verdicts),
    "peak_flops": lambda name: peak_flops.rules_table(_named(peak_flops)(name), recordings.GPU_SOURCE_NAME),
}


def render(source: str, where: str) -> str:
    """`source` with every placeholder filled and every held(...) expanded; UnknownPlaceholder names
    `where` and the line."""
    return _expand_held(fill_placeholders(source, where), where)


def held(selector: str, offset_seconds: int = 0) -> str:
    """`selector` (at `offset_seconds` before the evaluation), or where its target is not fresh its last
    value within HOLD_SECONDS: the target's scrape failed (`up` 0, or no target: it left discovery while
    its exporter restarts), or its exporter started less than SETTLE_SECONDS before."""
    at = f" offset {offset_seconds}s" if offset_seconds else ""
    now = f"time() - {offset_seconds}" if offset_seconds else "time()"
    fresh = (f"up{at} == 1 unless on (instance, job) "
             f"{now} - {families.EXPORTER_START_TIME}{at} < {SETTLE_SECONDS}")
    return f"({selector}{at} or (last_over_time({selector}[{HOLD_SECONDS}s]{at}) unless on (instance, job) ({fresh})))"


def _expand_held(text: str, where: str) -> str:
    expanded = HELD.sub(lambda m: held(m["selector"], int(m["offset"] or 0) * (60 if m["unit"] == "m" else 1)), text)
    if leftover := HELD_CALL.search(expanded):
        line = expanded.count("\n", 0, leftover.start()) + 1
        raise UnknownPlaceholder(f"{where}: held(...) near rendered line {line} must hold one selector "
                                 "(metric{labels}, optionally `offset Ns`)")
    return expanded


def _inline_rules(text: str, where: str) -> str:
    """`text` (placeholders filled) with each <<rule:NAME>> replaced by the expression of the recording
    stepscope.contract.recordings.NAME in it (its own <<rule:...>> replaced too), in parentheses, its lines
    indented as the placeholder's line."""
    if not RULE.search(text):
        return text
    exprs = {rule["record"]: rule["expr"].strip() for group in yaml.safe_load(text)["groups"]
             for rule in group["rules"] if "record" in rule}

    def expression(name: str, line: int, chain: tuple[str, ...]) -> str:
        record = getattr(recordings, name, None) if name.isupper() else None
        if record not in exprs or name in chain:
            raise UnknownPlaceholder(f"{where}:{line}: <<rule:{name}>> names no recording of this file, or one "
                                     f"that reads itself through <<rule:...>> ({' -> '.join((*chain, name))})")
        return _substitute_rules(exprs[record], lambda inner, _: expression(inner, line, (*chain, name)))
    return _substitute_rules(text, lambda name, line: expression(name, line, ()))


def _substitute_rules(text: str, expression: Callable[[str, int], str]) -> str:
    """`text` with each <<rule:NAME>> replaced by `expression(NAME, line)` in parentheses, on lines of their own
    indented as the placeholder's line (two spaces more inside)."""
    def inline(match: re.Match[str], line: int, indent: str) -> str:
        inner = "\n".join(f"{indent}  {part}" if part else "" for part in expression(match[1], line).splitlines())
        return f"(\n{inner}\n{indent})"
    return "".join(RULE.sub(lambda m, n=number, r=row: inline(m, n, r[:len(r) - len(r.lstrip())]), row)
                   for number, row in enumerate(text.splitlines(keepends=True), start=1))


def fill_placeholders(source: str, where: str) -> str:
    """`source` with every placeholder filled (<<rule:...>> last, with the expression filled), held(...) as
    written."""
    def fill(match: re.Match[str], line: int, indent: str) -> str:
        kind, name = match.groups()
        if kind == "rule":
            return match.group(0)
        try:
            return KINDS[kind](name).replace("\n", "\n" + indent)
        except (KeyError, ValueError):
            known = ", ".join((*KINDS, "rule"))
            raise UnknownPlaceholder(f"{where}:{line}: unknown placeholder {match.group(0)} "
                                     f"(kinds: {known}; names from stepscope_contract)") from None
    filled = "".join(PLACEHOLDER.sub(lambda m, n=number, t=text: fill(m, n, t[:len(t) - len(t.lstrip())]), text)
                     for number, text in enumerate(source.splitlines(keepends=True), start=1))
    return _inline_rules(filled, where)
