"""The names the README and the reference pages (docs/*.md) tell a user to query or type are the ones the
code has: recorded series the shipped rules record, metric families of the contract, the exporter's flags.
A rename in the code that leaves a page behind fails here, in well under a second, rather than in a user's
empty Grafana panel or an "unrecognized arguments" at start."""

import re

import yaml

from grafana.rules import RULE_FILES
from stepscope.contract import FAMILIES
from stepscope.exporter.cli import COLLECTOR_NAMES, build_parser
from stepscope.hooks.config import (
    ENVIRONMENT,
    KUBEFLOW_JOB_VARIABLES,
    LAUNCHER_RANKS,
    RAY_JOB_VARIABLE,
    SLURM_JOB_VARIABLES,
    Config,
)
from tests.support.readme import DOCS, documents

# a recorded series written out in full (`level:metric:operation`); `..._sm_active:training_ratio` and
# `instance_gpu_run:stepscope_gpu_*_trained:avg_ratio` abbreviate names the same sentence spells in full
RECORDED_NAME = re.compile(r"(?<![\w.*])[a-z_]+:stepscope_\w+:\w+(?![\w*])")
FAMILY_NAME = re.compile(r"(?<![\w:])stepscope_[a-z0-9_]+\b(?![:*])")
# a family prefix or a Python package, not a metric: `stepscope_training_*`, stepscope_contract/
NOT_FAMILIES = re.compile(r"stepscope_(?:contract|testkit|shard|training_|gpu_)$")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9.-]*[a-z0-9]")
# flags docs/exporter.md names that are another command's: the benchmarks it cites, stepscope-profile
OTHER_COMMANDS_FLAGS = {"--baseline-rev", "--peer-python", "--per-call", "--side-by-side", "--token-file"}


def recorded_series() -> set[str]:
    return {rule["record"] for path in RULE_FILES for group in yaml.safe_load(path.read_text())["groups"]
            for rule in group["rules"] if "record" in rule}


def exposed_names() -> set[str]:
    """Every name a scrape can show for a contract family: histograms' parts, counters with their _total."""
    names = set()
    for name in FAMILIES:
        names |= {name, f"{name}_bucket", f"{name}_sum", f"{name}_count"}
        names.add(name.removesuffix("_total"))  # a counter's family name as the client libraries spell it
    return names


def named(pattern: re.Pattern[str], skip: re.Pattern[str] | None = None) -> dict[str, list[str]]:
    """Each match of `pattern` in the documents -> where it is (file:line)."""
    found: dict[str, list[str]] = {}
    for path in documents():
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for name in pattern.findall(line):
                if skip is None or not skip.search(name):
                    found.setdefault(name, []).append(f"{path.name}:{number}")
    return found


def test_every_recorded_series_the_docs_name_is_recorded_by_the_shipped_rules() -> None:
    recorded = recorded_series()
    documented = named(RECORDED_NAME)
    assert len(documented) > 40
    assert {name: where for name, where in documented.items() if name not in recorded} == {}


def test_every_metric_family_the_docs_name_is_in_the_contract() -> None:
    exposed = exposed_names()
    documented = named(FAMILY_NAME, NOT_FAMILIES)
    assert len(documented) > 60
    assert {name: where for name, where in documented.items() if name not in exposed} == {}


def test_every_flag_the_exporter_page_names_is_the_exporters() -> None:
    text = (DOCS / "exporter.md").read_text()
    for switch in ("--collector", "--no-collector"):  # `--collector.NAME`: each collector's
        text = text.replace(f"{switch}.NAME", " ".join(f"{switch}.{name}" for name in COLLECTOR_NAMES))
    parser_flags = {flag for action in build_parser()._actions for flag in action.option_strings}
    documented = set(FLAG.findall(text)) - OTHER_COMMANDS_FLAGS
    assert len(documented) > 30
    assert documented - parser_flags == set()


def test_the_hooks_phase_limit_is_the_exporters_and_both_pages_tie_them() -> None:
    """A rank whose `max_phases=` passes the exporter's `--ingest-max-phases` has every push refused whole
    (400 too_many_phases: its steps and state never stored); the pages said only "at most 32 (`max_phases=`)"."""
    assert Config(run="r").max_phases == build_parser().parse_args([]).ingest_max_phases == 32
    hooks = " ".join((DOCS / "hooks.md").read_text().split())
    assert ("(`max_phases=`), then one warning and further new names are ignored. The exporter refuses a push with "
            "more phases than its `--ingest-max-phases` (32) whole") in hooks
    exporter = " ".join((DOCS / "exporter.md").read_text().split())
    assert "`--ingest-max-phases` (32; the hooks' `max_phases=` must not pass it" in exporter


def test_every_environment_variable_the_hooks_read_has_a_row_in_the_hooks_environment_table() -> None:
    """README sends users to docs/hooks.md for "every environment variable"; its table lacked STEPSCOPE_FLOPS_DTYPE
    and STEPSCOPE_PEAK_FLOPS, which `th.init` reads (a user setting them from the table found nothing there)."""
    section = (DOCS / "hooks.md").read_text().split("## Environment", 1)[1].split("\n## ", 1)[0]
    rows = {name for row in re.findall(r"^\| (`[A-Z_]+`(?:, `[A-Z_]+`)*) \|", section, re.M)
            for name in re.findall(r"`([A-Z_]+)`", row)}
    launchers = {variable for _, *variables in LAUNCHER_RANKS for variable in variables}
    assert (set(ENVIRONMENT.values()) | launchers | set(SLURM_JOB_VARIABLES) | set(KUBEFLOW_JOB_VARIABLES)
            | {RAY_JOB_VARIABLE}) - rows == set()


def test_the_downward_api_example_for_jobs_that_name_no_run_is_a_container_env() -> None:
    """docs/hooks.md tells JobSet and Indexed Job users, whose controllers set no variable naming the job, to take
    STEPSCOPE_RUN from a pod label: the example must be a container's `env` that Kubernetes takes as written."""
    section = (DOCS / "hooks.md").read_text().split("label with the downward API:\n", 1)[1]
    example = yaml.safe_load(section.split("```yaml\n", 1)[1].split("```", 1)[0])
    assert example == {"env": [{"name": "STEPSCOPE_RUN", "valueFrom": {"fieldRef": {
        "fieldPath": "metadata.labels['jobset.sigs.k8s.io/jobset-name']"}}}]}
