"""stepscope exporter: node, GPU and per-process metrics plus pushed training timings on /metrics."""

__version__ = "0.1.0"
