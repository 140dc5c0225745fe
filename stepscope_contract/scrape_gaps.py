"""How the rules ride out a gap in a target's scrapes (docs/alerts.md#scrape-gaps).

Prometheus and VictoriaMetrics mark every series of a target stale when a scrape of it fails, and a
restarted exporter serves no pushed series until each rank pushes again (a push refused while it was
down is retried at the push interval, 5 s; one that timed out while it hung backs off: 10 s, then 20 s).
An instant read then finds nothing for that evaluation: a firing alert resolves and a pending one starts
its `for` again, though nothing about the training changed.

The rules read a target's gauges through `held(...)` (grafana/rules/render.py): where its latest scrape
failed or its exporter started less than SETTLE_SECONDS ago, a series it no longer shows keeps its last
value from the last HOLD_SECONDS. A series that leaves a healthy target's scrape leaves the rules at
once, as before.
"""

# As long as the rules' rate windows (1m): a longer gap empties those anyway, and is
# StepscopeExporterDown's to report.
HOLD_SECONDS = 60
# Counted from the exporter's start: every rank has pushed again within its interval (5 s) when its pushes
# were refused, and within the backoff (10 s after one timed-out push, 20 s after two) when they hung.
SETTLE_SECONDS = 30
