#!/usr/bin/env bash
# Sets up everything the test suite needs on a fresh Debian machine, then runs it.
# Debian packages: Prometheus, promtool, the Pushgateway, Alertmanager and amtool, node_exporter (for benchmarks), and
# Chromium with its WebDriver (the report page is checked in a real headless browser), VictoriaMetrics with
# vmalert (the second engine the rules are proven on, docs/engines.md).
# Python: a virtualenv in .venv with the CPU build of torch, then the project with its test extras.
set -euo pipefail
cd "$(dirname "$0")/.."

apt_packages=(prometheus prometheus-pushgateway prometheus-node-exporter prometheus-alertmanager chromium chromium-driver
              victoria-metrics)
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
# Most tests wait on real processes (Prometheus scrapes, training runs, deadlines): six workers, each taking
# whole modules so a module's Prometheus and training runs start once, in tests/conftest.py's order, longest
# first (--no-loadscope-reorder: xdist's default order, most tests first, left the long few-test modules to start
# last). On 2 cores: -n 3 524 s and -n 6 373 s in xdist's order; in ours -n 5 384 s and -n 6 353-374 s. -n 8 took
# 319-336 s in eight runs, but the machine is then 88% busy (576 s of CPU in 327 s) and the tests that hold the
# hooks' timings to the truth failed twice in one clean-clone run (a loading share 0.024 off, a checkpoint's
# seconds 11% short), and once more in another run: six workers, for a suite that is green every time.
# `-n 0` runs everything in this process.
# Bytecode is cached (in the git-ignored __pycache__/) even where the environment turns it off: every worker
# collects every module (5.4 s of user CPU each without the cache, 3.3 s with it), and each test process that imports the
# project saves its compile (0.22 s -> 0.16 s).
unset PYTHONDONTWRITEBYTECODE
# The modules marked `alone` (pyproject.toml) then run with the machine to themselves: the real-GPU recordings
# replayed at their pace to Prometheus and VictoriaMetrics evaluating every rule each second. Beside five busy
# workers (load average ~13 on 2 cores) vmalert missed 326-586 iterations and Prometheus 24-63 while a workload
# trained, and the verdicts went out for seconds at a time (tests/test_corpus_verdicts.py); alone, none missed.
# The energy tests join them: their charge is exact at a 1 s evaluation, and beside the others Prometheus
# evaluated the GPU mapping twice in 20 s (tests/test_energy_e2e.py charged 4 s of the 18.6 s held).
# Exit status 5 is pytest's "no tests collected": arguments that select none of one phase's tests.
status=0
.venv/bin/python -m pytest -n 6 --dist loadfile --no-loadscope-reorder -m "not alone" "$@" || status=$?
[ "$status" -eq 5 ] && status=0
alone=0
.venv/bin/python -m pytest -m alone "$@" || alone=$?
[ "$alone" -eq 5 ] && alone=0
[ "$status" -ne 0 ] && exit "$status"
exit "$alone"
