"""stepscope exporter: node, GPU and per-process metrics plus pushed training timings on /metrics."""

from stepscope.contract import VERSION as __version__

__all__ = ["__version__"]
