"""Collection order: the modules with the longest chains of real processes first.

`scripts/test.sh` runs the suite on pytest-xdist workers, each taking whole modules (--dist loadfile:
module fixtures such as a Prometheus fed by training runs start once), in this order
(--no-loadscope-reorder: xdist's default hands out the modules with the most tests first, which left
the long few-test modules here to start last and run alone at the end). A long module that starts
last keeps one worker busy after the others finish; starting those first lets the short modules fill
the gaps. The order changes only the wall time, never what runs.
"""

import os

import pytest

# The Go servers and tools the tests start (Prometheus, promtool, VictoriaMetrics, vmalert, Alertmanager, the
# Pushgateway) collect their garbage four times less often: each is short-lived and small, and at Go's default
# (GOGC=100) the collector was a fifth of their CPU on this 2-core machine (a Prometheus with the shipped rules
# scraping an exporter for 60 s: 2.35 s of CPU, 1.89 s at 400; `promtool test rules` over grafana/rules/tests:
# 25.8 s, 18.7 s), for about 1.5x their memory. What they compute is the same. A GOGC set outside is kept.
os.environ.setdefault("GOGC", "400")

LONGEST_FIRST = (  # wall seconds measured at -n 3 on a 2-core machine (set up + tests), CPU seconds beside
    "test_quantiles_e2e.py",        # 108 (29): VictoriaMetrics' verdict lag dominates
    "test_framework_quantiles.py",  # 105 (24): a Lightning fit and a Trainer run of 100 s at once, via Prometheus
    "test_gpu_signals_e2e.py",      # 101 (7): 1m GPU averages turning over twice after a scenario change
    "test_sharded_e2e.py",          # 97 (13): the shard layout, once per global engine
    "test_stall_e2e.py",            # 92 (26): a hung run named within two minutes
    "test_dcgm_source.py",          # 82 (8): the corpus again, dcgm-exporter as the GPU source
    "test_scrape_gap_e2e.py",       # 73 (15 at -n 0): until both engines fire, then an exporter restart watched 20 s
    "test_report_e2e.py",           # 72 (35): two training runs of 45 s (the verdict waits 30 s), reports
    "test_alertmanager_e2e.py",     # 80 at -n 0 (8): a rank lost, then an exporter restart watched through Alertmanager
    "test_first_step_e2e.py",       # 60-75 on a loaded machine: two 2-rank DDP runs, one hanging in its first step
    "test_report_victoria_e2e.py",  # 72 alone: a run until VictoriaMetrics + vmalert record its verdict, two reports
    "test_bundle_e2e.py",           # 43 (34): training runs, Prometheus, every rule and panel query
    "test_pod_labels.py",           # 39 (9): two exporters, a run on each, until both have their verdict
    "test_framework_truth.py",      # 23 (17)
    "test_corpus_scrape_interval.py",  # 20 at -n 0 on a loaded machine: ten promtool runs, two at a time
    "test_readme_commands.py",      # 20 (29): every demo command at once, a CPU burst
    "test_http_hardening.py",       # 17 (13): 512 groups, shutdown deadlines
    "test_helm_chart.py",           # 15 (15)
)


# The `alone` phase's modules, longest first (seconds of their set up on two workers, beside the background
# phase). xdist hands a worker its next module once it has two tests or fewer left. In collection order
# (alphabetical) one worker ran the replay, then the quickstart (144 + 101 s), while the other ran the dropped
# bounds, energy and goodput (74 + 37 + 47 s) and then waited. Longest first, the quickstart starts beside the replay
# (its single test lets the dropped bounds queue behind it), goodput follows them and energy the replay:
# 101 + 74 + 47 against 144 + 37 s.
ALONE_LONGEST_FIRST = (
    "test_corpus_verdicts.py",      # 144: the recorded workloads replayed at their pace, 1.5 times on VictoriaMetrics
    "test_quickstart.py",           # 101: the README's quickstart, two acts of training judged by the rules
    "test_dropped_bounds_e2e.py",   # 74: a minute of pushes after the dropped bounds, both engines
    "test_goodput_e2e.py",          # 47
    "test_energy_e2e.py",           # 37
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        order = ALONE_LONGEST_FIRST if item.get_closest_marker("alone") else LONGEST_FIRST
        name = item.path.name
        return order.index(name) if name in order else len(order)

    items.sort(key=rank)  # stable: the order inside a module, and of the other modules, is kept
