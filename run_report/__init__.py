"""stepscope-report: a training run's report from a Prometheus server's HTTP API.

One self-contained HTML page (verdict in words, plots, a Gantt chart of each rank's states, tables)
plus CSVs like a job report, from the series the stepscope exporter publishes and the recording
rules of the Grafana bundle. `python -m stepscope.report --help`.
"""
