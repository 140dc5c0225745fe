"""Grafana alert provisioning generated from the Prometheus rules file."""
