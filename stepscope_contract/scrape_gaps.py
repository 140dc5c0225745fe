"""How the rules ride out a gap in a target's scrapes (docs/alerts.md#scrape-gaps).

Prometheus and VictoriaMetrics mark every series of a target stale when a scrape of it fails, and a
restarted exporter serves no pushed series until each rank pushes again (within its backoff: 10-20 s
after a restart of a few seconds). An instant read then finds nothing for that evaluation: a firing
alert resolves and a pending one starts its `for` again, though nothing about the training changed.
The rules read a target's gauges through `held(...)` (grafana/rules/render.py): where its latest
scrape failed or its exporter started less than SETTLE_SECONDS ago, a series it no longer shows
keeps its last value from the last HOLD_SECONDS. A series that leaves a healthy target's scrape
leaves the rules at once, as before.
"""

# As long as the rules' rate windows (1m): a longer gap empties those anyway, and is
# StepscopeExporterDown's to report.
HOLD_SECONDS = 60
# Longer than the hooks' push interval (5 s) doubled twice: the retry of a rank whose pushes failed for
# the few seconds a restart takes.
SETTLE_SECONDS = 30
