"""Profile requests through a real exporter's API, and what a written trace holds."""

import gzip
import json
import time
from pathlib import Path
from typing import Any

import requests

API = "/api/v1/profiles"
GPU_ANNOTATION = "gpu_user_annotation"  # Kineto's category for annotations on the GPU timeline


def request_trace(exporter: str, run: str, rank: int, steps: int) -> str:
    """Asks the exporter for a trace of one rank; the request's id."""
    response = requests.post(f"{exporter}{API}", json={"run": run, "ranks": [rank], "steps": steps}, timeout=10)
    assert response.status_code == 201, response.text
    return response.json()["requests"][0]["id"]


def request_state(exporter: str, request_id: str) -> dict[str, Any]:
    response = requests.get(f"{exporter}{API}/{request_id}", timeout=10)
    response.raise_for_status()
    return response.json()


def rank_tracing(exporter: str, run: str, rank: int) -> str:
    """What the rank's last push said about tracing ("" before its first push)."""
    listing = requests.get(f"{exporter}{API}", params={"run": run}, timeout=10).json()
    return next((r["tracing"] for r in listing["ranks"] if r["rank"] == str(rank)), "")


def wait_until(condition: Any, timeout: float, what: str, interval: float = 0.1) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout}s")
        time.sleep(interval)


def step_annotations(path: str | Path) -> list[str]:
    """The `ProfilerStep#N` names of a gzipped Chrome trace (which must parse as one), one per step.

    A trace with CUDA activity holds each step twice: the CPU-side annotation (category
    `user_annotation`) and its projection on the GPU timeline (`gpu_user_annotation`). Only the CPU
    side counts: every recorded step has it, while a step without GPU work has no GPU-side one.
    """
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        trace = json.load(handle)
    assert isinstance(trace["traceEvents"], list)
    return sorted(
        (event["name"] for event in trace["traceEvents"]
         if event.get("ph") == "X" and event.get("cat") != GPU_ANNOTATION
         and str(event.get("name", "")).startswith("ProfilerStep#")),
        key=lambda name: int(name.split("#")[1]),
    )


def kernel_names(path: str | Path) -> list[str]:
    """Names of the GPU kernels a gzipped Chrome trace shows (category `kernel`)."""
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        trace = json.load(handle)
    return [event["name"] for event in trace["traceEvents"] if event.get("cat") == "kernel"]
