"""Dashboards generated with grafana-foundation-sdk; the committed JSON is their output."""
