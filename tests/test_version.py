"""The version lives in stepscope.contract.VERSION; everything that states it reads it or is checked here."""

import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

import yaml

from stepscope.contract import VERSION
from stepscope.hooks.pusher import USER_AGENT

REPO = Path(__file__).resolve().parents[1]


def test_the_installed_distribution_takes_its_version_from_the_contract() -> None:
    assert importlib.metadata.version("stepscope") == VERSION


def test_the_exporter_reports_it() -> None:
    result = subprocess.run([sys.executable, "-m", "stepscope.exporter", "--version"], capture_output=True, text=True)
    assert result.stdout.strip().endswith(f" {VERSION}"), result.stdout + result.stderr
    assert f"stepscope-training-hooks/{VERSION}" == USER_AGENT


def test_the_chart_app_version_and_the_image_label_match() -> None:
    chart = yaml.safe_load((REPO / "helm" / "stepscope" / "Chart.yaml").read_text())
    assert chart["appVersion"] == VERSION, "helm/stepscope/Chart.yaml appVersion (the default image tag)"
    dockerfile = (REPO / "docker" / "Dockerfile").read_text()
    assert re.findall(r"^ARG VERSION=(\S+)$", dockerfile, re.M) == [VERSION], "docker/Dockerfile ARG VERSION"
