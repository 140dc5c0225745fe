"""Collection order: the modules with the longest chains of real processes first.

`scripts/test.sh` runs the suite on pytest-xdist workers, each taking whole modules (--dist loadfile:
module fixtures such as a Prometheus fed by training runs start once). A long module that starts
last keeps one worker busy after the others finish; starting those first lets the short modules fill
the gaps. The order changes only the wall time, never what runs.
"""

import pytest

LONGEST_FIRST = (  # seconds on a 2-core machine: set up + tests, roughly
    "test_gpu_signals_e2e.py",   # ~165: 1m GPU averages turning over twice after a scenario change
    "test_quickstart.py",        # ~130: the quickstart's two acts (each waits for its verdict), Ctrl-C, SIGKILL
    "test_framework_quantiles.py",  # ~145: a Lightning fit and a Trainer run of 100 s at once, read via Prometheus
    "test_corpus_verdicts.py",   # ~165: the H100 and H200 recordings replayed at their pace, two engines at once
    "test_dcgm_source.py",       # ~90: the same, dcgm-exporter as the GPU source
    "test_report_e2e.py",        # ~80: two training runs of 45 s (the verdict waits 30 s), reports
    "test_pod_labels.py",        # ~45: two exporters, a run on each, until both have their verdict (30 s)
    "test_pod_labels_rules.py",  # ~35: every promtool file again, with pod labels on its inputs
    "test_readme_install.py",    # ~30: a fresh venv (pip, mostly waiting)
    "test_http_hardening.py",    # ~45: 512 groups, shutdown deadlines
    "test_bundle_e2e.py",        # ~30: training runs, Prometheus, every rule and panel query
    "test_readme_commands.py",   # ~25: every demo command at once, a CPU burst: not beside the report
                                 # module's training runs, whose state timeline the report tests time
    "test_hooks_demo_ddp.py",    # ~20: DDP over gloo
    "test_profile_e2e.py",       # ~25: traces of live ranks
    "test_hooks_sigterm.py",     # ~20
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        name = item.path.name
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: the order inside a module, and of the other modules, is kept
