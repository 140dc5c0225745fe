#!/usr/bin/env bash
# The test run itself, in two phases, once scripts/test.sh has set up the machine; arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."

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
# So does the README's quickstart: its fixed act's 4 loader workers hand batches over at the machine's pace.
# Beside the others (the official CI on 3c9bf3c, the demo's first step 41 s late) the act waited for data 34-41%
# of the step for 100 s, over the 30% that is data-bound, and host_bound never came; alone it reads 19% (101 s).
# The alone phase runs on two workers: the replay (148 s, 0.87 of a core) on one, the energy, goodput and quickstart
# modules (36 + 48 + 101 s, a quarter of a core each) one after the other on the other: 197-200 s instead of
# 334 s, with the same readings as one at a time (0 missed iterations and 0 failed scrapes on either engine, the
# verdicts 2.3-3.3 s after the settle time on Prometheus, host_bound at 37 s in the quickstart).
# Exit status 5 is pytest's "no tests collected": arguments that select none of one phase's tests.
# A marker expression among the arguments (`-m gpu`, `-mgpu`) narrows each phase's own rather than replacing
# both (pytest keeps the last -m), which ran the selected tests twice, the second time beside nothing.
args=() wanted=""
while [ $# -gt 0 ]; do
  case "$1" in
    -m) [ $# -ge 2 ] || { echo "scripts/test.sh: -m needs a marker expression" >&2; exit 4; }
        wanted="$2"; shift 2 ;;
    -m?*) wanted="${1#-m}"; shift ;;
    *) args+=("$1"); shift ;;
  esac
done
phase_marker() { if [ -n "$wanted" ]; then echo "($wanted) and $1"; else echo "$1"; fi; }
status=0
.venv/bin/python -m pytest -n 6 --dist loadfile --no-loadscope-reorder -m "$(phase_marker "not alone")" \
  ${args[@]+"${args[@]}"} || status=$?
[ "$status" -eq 5 ] && status=0
alone=0
.venv/bin/python -m pytest -n 2 --dist loadfile --no-loadscope-reorder -m "$(phase_marker alone)" \
  ${args[@]+"${args[@]}"} || alone=$?
[ "$alone" -eq 5 ] && alone=0
[ "$status" -ne 0 ] && exit "$status"
exit "$alone"
