#!/usr/bin/env bash
# Sets up everything the test suite needs on a fresh Debian machine, then runs it.
# Debian packages: Prometheus, promtool, the Pushgateway, Alertmanager and amtool, node_exporter (for benchmarks), and
# Chromium with its WebDriver (the report page is checked in a real headless browser), VictoriaMetrics with
# vmalert (the second engine the rules are proven on, docs/engines.md), and systemd for systemd-analyze (the shipped
# unit, deploy/systemd, is verified; nothing is started).
# Python: a virtualenv in .venv with the CPU build of torch, then the project with its test extras.
set -euo pipefail
cd "$(dirname "$0")/.."

apt_packages=(prometheus prometheus-pushgateway prometheus-node-exporter prometheus-alertmanager chromium chromium-driver
              victoria-metrics systemd)
missing=()
for pkg in "${apt_packages[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
  sudo_cmd=""
  [ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
  $sudo_cmd apt-get update -q
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -q --no-install-recommends "${missing[@]}"
fi
# The Debian packages start their daemons through systemd where it runs; tests start their own.

python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# The CPU build of torch, before the extras could pull PyPI's build of it (CUDA, several GB): from
# PyTorch's CPU index; where that index cannot be reached, pip's configured indexes and find-links
# must hold a CPU build of this pin (as the machines this project is developed on do).
.venv/bin/python -m pip install -q --timeout 20 --retries 1 --index-url https://download.pytorch.org/whl/cpu torch==2.13.0
.venv/bin/python -m pip install -q -e '.[test]'

.venv/bin/ruff check .
exec bash scripts/test_phases.sh "$@"
