"""A rules source -> the rule file Prometheus loads: contract names filled in where the source says
`<<kind:NAME>>`, so a rename in stepscope_contract reaches the rules with `python -m grafana generate`.

    <<family:STEPS_TOTAL>>             stepscope.contract.families.STEPS_TOTAL (add _bucket etc. after it)
    <<record:RUN_VERDICT>>             stepscope.contract.recordings.RUN_VERDICT
    <<node_join:NODE_CLOCK_OFFSET>>    that per-node recording joined onto a node's series: `on (instance, job)
                                       group_left () instance:stepscope_node_clock_offset:seconds`
    <<threshold:data_loading_share>>   THRESHOLDS["data_loading_share"] as a number (0.3)
    <<percent:data_loading_share>>     the same as a share (30%), for annotations
    <<duration:rank_lost_max_seconds>> a threshold in seconds as words (6 hours), for annotations
    <<phase:DATA_LOADING_PHASE>>       a phase constant of stepscope.contract.training
    <<phases:LOCAL_PHASES>>            a tuple of phases as a regex alternation (a|b|c)
    <<state:TRAIN_STATE>>              a state constant of stepscope.contract.training
    <<timing:HOST_TIMING>>             a `timing` value of stepscope.contract.training
    <<timings:GPU_TIMINGS>>            a tuple of `timing` values as a regex alternation
    <<verdict:DATA_BOUND>>             a verdict of stepscope.contract.verdicts
    <<holder:FOREIGN>>                 a `holder` of stepscope.contract.families (HOLDER_FOREIGN)
    <<peak_flops:BF16>>                the peak FLOP/s table for a dtype of stepscope.contract.peak_flops
                                       (several lines, each indented as the placeholder's line)

The `<<` `>>` brackets never clash with the `{{ $value }}` templates of alert annotations.

After the placeholders, `dcgm_node(EXPR)` becomes EXPR with dcgm-exporter's node name in `instance`: it names
the node in `Hostname` (`hostname` from its May 2026 release on), and the rules join on `instance`. Its target's own
`instance` (the pod's address) goes first: a node's dcgm-exporter pod replaced (a DaemonSet rollout) leaves the old
pod's series beside the new one's, held for a minute and within an hour's ranges, and the two sets, the same but for
that address, made the node's name a duplicate label set (every GPU source rule of the cluster failed).

Then `held(SELECTOR)` or `held(SELECTOR offset D)` becomes the selector, or where its
target's latest scrape failed or its exporter started less than SETTLE_SECONDS before, its last value
from the last HOLD_SECONDS (stepscope_contract/scrape_gaps.py says why): a scrape gap then changes no
alert. The selector keeps its `instance` and `job` labels for that (read it inside any aggregation).
"""

import re
from collections.abc import Callable

from stepscope.contract import THRESHOLDS, families, peak_flops, recordings, training, verdicts
from stepscope.contract.scrape_gaps import HOLD_SECONDS, SETTLE_SECONDS

PLACEHOLDER = re.compile(r"<<(\w+):(\w+)>>")
HELD_CALL = re.compile(r"\bheld\(")
DCGM_NODE_CALL = re.compile(r"\bdcgm_node\(")
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
    "node_join": lambda name: f"on (instance, job) group_left () {_named(recordings)(name)}",
    "threshold": lambda name: THRESHOLDS[name].number,
    "percent": lambda name: THRESHOLDS[name].percent,
    "duration": lambda name: THRESHOLDS[name].duration,
    "phase": _named(training, "_PHASE"),
    "phases": _named(training, "PHASES", tuple),
    "state": _named(training, "_STATE"),
    "timing": _named(training, "_TIMING"),
    "timings": _named(training, "TIMINGS", tuple),
    "verdict": _named(verdicts),
    "holder": lambda name: _named(families)(f"HOLDER_{name}"),
    "peak_flops": lambda name: peak_flops.rules_table(_named(peak_flops)(name), recordings.GPU_SOURCE_NAME),
}


def render(source: str, where: str) -> str:
    """`source` with every placeholder filled and every held(...) expanded; UnknownPlaceholder names
    `where` and the line."""
    return _expand_held(_expand_dcgm_node(fill_placeholders(source, where), where), where)


def held(selector: str, offset_seconds: int = 0) -> str:
    """`selector` (at `offset_seconds` before the evaluation), or where its target is not fresh its last
    value within HOLD_SECONDS: the target's scrape failed (`up` 0, or no target: it left discovery while
    its exporter restarts), or its exporter started less than SETTLE_SECONDS before."""
    at = f" offset {offset_seconds}s" if offset_seconds else ""
    now = f"time() - {offset_seconds}" if offset_seconds else "time()"
    fresh = (f"up{at} == 1 unless on (instance, job) "
             f"{now} - {families.EXPORTER_START_TIME}{at} < {SETTLE_SECONDS}")
    return f"({selector}{at} or (last_over_time({selector}[{HOLD_SECONDS}s]{at}) unless on (instance, job) ({fresh})))"


def dcgm_node(expr: str) -> str:
    """`expr` with `instance` set from dcgm-exporter's `Hostname`, or its newer releases' `hostname`: one series
    per node and labels, however many of the node's dcgm-exporter targets (pods) `expr` still holds."""
    return (f'label_replace(label_replace(max without (instance) ({expr}), "instance", "$1", "Hostname", "(.+)"), '
            '"instance", "$1", "hostname", "(.+)")')


def _expand_dcgm_node(text: str, where: str) -> str:
    """Every dcgm_node(EXPR) expanded, innermost first; EXPR runs to the parenthesis that closes the call."""
    while match := DCGM_NODE_CALL.search(text):
        end = _closing(text, match.end())
        if end is None:
            line = text.count("\n", 0, match.start()) + 1
            raise UnknownPlaceholder(f"{where}: dcgm_node( near rendered line {line} is never closed")
        text = text[:match.start()] + dcgm_node(_expand_dcgm_node(text[match.end():end], where)) + text[end + 1:]
    return text


def _closing(text: str, start: int) -> int | None:
    """The index of the `)` that closes a parenthesis opened just before `start`, skipping quoted strings (a
    label_replace regex holds parentheses); an escaped quote (inside an annotation's printf) is no quote."""
    depth, quoted = 0, False
    for index in range(start, len(text)):
        char = text[index]
        if char == '"' and text[index - 1] != "\\":
            quoted = not quoted
        elif quoted:
            continue
        elif char == "(":
            depth += 1
        elif char == ")":
            if depth == 0:
                return index
            depth -= 1
    return None


def _expand_held(text: str, where: str) -> str:
    expanded = HELD.sub(lambda m: held(m["selector"], int(m["offset"] or 0) * (60 if m["unit"] == "m" else 1)), text)
    if leftover := HELD_CALL.search(expanded):
        line = expanded.count("\n", 0, leftover.start()) + 1
        raise UnknownPlaceholder(f"{where}: held(...) near rendered line {line} must hold one selector "
                                 "(metric{labels}, optionally `offset Ns`)")
    return expanded


def fill_placeholders(source: str, where: str) -> str:
    """`source` with every placeholder filled, held(...) as written."""
    def fill(match: re.Match[str], line: int, indent: str) -> str:
        kind, name = match.groups()
        try:
            return KINDS[kind](name).replace("\n", "\n" + indent)
        except (KeyError, ValueError):
            known = ", ".join(KINDS)
            raise UnknownPlaceholder(f"{where}:{line}: unknown placeholder {match.group(0)} "
                                     f"(kinds: {known}; names from stepscope_contract)") from None
    return "".join(PLACEHOLDER.sub(lambda m, n=number, t=text: fill(m, n, t[:len(t) - len(t.lstrip())]), text)
                   for number, text in enumerate(source.splitlines(keepends=True), start=1))
