"""How the rules ride out a gap in a target's scrapes (docs/alerts.md#scrape-gaps).

Prometheus and VictoriaMetrics mark every series of a target stale when a scrape of it fails, and a
restarted exporter serves no pushed series until each rank pushes again (the hooks retry a failed push
after 10 s, after a second failure 20 s later). An instant read then finds nothing for that evaluation:
a firing alert resolves and a pending one starts its `for` again, though nothing about the training
changed.

The rules read a target's gauges through `held(...)` (grafana/rules/render.py): where its latest
scrape failed or its exporter started less than SETTLE_SECONDS ago, a series it no longer shows keeps
its last value from the last HOLD_SECONDS. A series that leaves a healthy target's scrape leaves the
rules at once, as before.
"""

# As long as the rules' rate windows (1m): a longer gap empties those anyway, and is
# StepscopeExporterDown's to report.
HOLD_SECONDS = 60
# Counted from the exporter's start: a rank whose push failed while it was down retries 10 s after that
# push (the hooks' 5 s interval doubled), one that failed twice 20 s after the second.
SETTLE_SECONDS = 30
