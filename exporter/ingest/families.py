"""The families the push API accepts: one table the parser, the store and the renderer all read.

It is derived from the metric contract (stepscope_contract): the pushed families with their labels
less the URL's run and rank, their help and type, and a value rule from their kind. Adding an
optional label or a family is a change to the contract only.
"""

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import stepscope.contract
from stepscope.contract import Family


@dataclass(frozen=True)
class FamilySpec:
    """One accepted family: its exposed name (counters with `_total`), type and body labels.

    `values` names the rule every sample value must meet ("non_negative", "one", "zero_or_one");
    histograms have their own rules (finite non-negative cumulative counts, finite sum).
    """

    name: str
    type: str
    labels: tuple[str, ...]
    help: str
    optional: tuple[str, ...] = ()  # body labels a client may leave out (older clients do)
    values: str = "non_negative"
    body_labels: tuple[str, ...] = field(init=False)  # required then optional: the series key order

    def __post_init__(self) -> None:
        object.__setattr__(self, "body_labels", (*self.labels, *self.optional))


_VALUE_RULES = {"info": "one", "state set": "zero_or_one"}


def _accepted(spec: Family) -> FamilySpec:
    body = tuple(label for label in spec.labels if label not in stepscope.contract.PATH_LABELS)
    rule = _VALUE_RULES.get(spec.kind, "non_negative")
    return FamilySpec(spec.name, spec.type, body, spec.help, spec.optional, rule)


FAMILIES: Mapping[str, FamilySpec] = {
    name: _accepted(spec) for name, spec in stepscope.contract.FAMILIES.items() if spec.pushed
}
PATH_LABELS = stepscope.contract.PATH_LABELS  # from the URL; a body may repeat them only with the same values
RESERVED_LABELS = ("job", "instance")  # set by the scraping Prometheus, never by a pusher
NON_EMPTY_LABELS = frozenset({"phase", "state", "pid", "path"})
# Labels whose values may be longer than --ingest-max-label-value-length: file paths (PATH_MAX).
LONG_LABEL_LENGTHS: Mapping[str, int] = {"path": 4096}
PHASE_FAMILY = stepscope.contract.STEP_PHASE_SECONDS
STATE_FAMILY = stepscope.contract.TRAINING_STATE
INFO_FAMILY = stepscope.contract.TRAINING_INFO
LAST_PUSH_FAMILY = stepscope.contract.TRAINING_LAST_PUSH

_PID = re.compile(r"[1-9][0-9]{0,9}")
_START_TIME = re.compile(r"[0-9]{1,12}(\.[0-9]{1,9})?")  # Unix seconds, as psutil's create_time()
_INODE = re.compile(r"[1-9][0-9]{0,19}")  # a namespace's inode number, as stat(2) gives it

# Per label name: (check of a non-empty value, what the refusal says the value must be).
LABEL_RULES: Mapping[str, tuple[Callable[[str], object], str]] = {
    "pid": (_PID.fullmatch, "a positive process id"),
    # the rules count a rank as training by state="train": a state outside the set would hide it from them
    "state": (frozenset(stepscope.contract.STATES).__contains__, "one of " + ", ".join(stepscope.contract.STATES)),
    "start_time": (_START_TIME.fullmatch, "the process start time in Unix seconds (a non-negative decimal "
                                          "number like 1712345678.25)"),
    "pid_namespace": (_INODE.fullmatch, "the inode number of the process's pid namespace (a positive integer "
                                        "like 4026531836, from stat /proc/self/ns/pid)"),
}
