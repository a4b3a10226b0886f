#!/usr/bin/env bash
# The README's test command: install everything the tests need into a virtual
# environment of their own, then run them there, as a newcomer's machine would.
#   scripts/test.sh [pytest args...]
#
# As root it first provisions the real components (scripts/provision.sh).
# The venv is .venv in the checkout (PRORL_VENV elsewhere), made with
# `python3 -m venv` and no system site packages, so nothing the machine's own
# Python happens to hold can hide a missing install step; PRORL_FRESH_VENV=1
# removes an existing one first (CI does). pip's wheel cache is reused.
# The suite runs with PRORL_HOME set to a fresh folder: users set it, and a
# test that needs another home sets its own. PRORL_LANES=1 runs the
# waiting lane (tests/slurm, tests/node, tests/sandbox) and the model lane (vLLM, training, chaos) in
# pytests of their own beside the rest (CI does); given a test path, it runs
# one pytest, and a -k/-m filter may leave a lane with nothing to run.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ "$(id -u)" = 0 ]; then
  bash scripts/provision.sh
fi
venv="${PRORL_VENV:-.venv}"
if [ "${PRORL_FRESH_VENV:-0}" = 1 ]; then
  rm -rf "$venv"
fi
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
venv="$(cd "$venv" && pwd)"
install_start=$SECONDS
PRORL_PYTHON="$venv/bin/python" bash scripts/install.sh
echo "test.sh: the install took $((SECONDS - install_start)) s"
# The tests start `python3`, `prorl` and the venv's console scripts by name.
export PATH="$venv/bin:$PATH" VIRTUAL_ENV="$venv"
PRORL_HOME="$(mktemp -d "${TMPDIR:-/tmp}/prorl-home.XXXXXX")"
export PRORL_HOME
# pytest exits 5 when it collects no test; set -e makes that a failure too.
lanes="${PRORL_LANES:-0}"
filtered=0
previous=""
for arg in "$@"; do
  # A test path or node id picks its tests itself: in lanes each pytest would run it again beside its own.
  # (A path that is an option's value, --deselect tests/x.py::t or --ignore tests/y, picks nothing.)
  case "$previous" in
    --deselect|--ignore|--ignore-glob) ;;
    *) case "$arg" in tests|tests/*) if [ -e "${arg%%::*}" ]; then lanes=0; fi ;; esac ;;
  esac
  case "$arg" in -k|-k*|-m|-m*) filtered=1 ;; esac
  previous="$arg"
done
if [ "$lanes" != 1 ]; then
  "$venv/bin/python" -m pytest -ra "$@"
  exit 0
fi
# PRORL_LANES=1 (CI): the suite runs as three pytests side by side, each with a home of its own:
#  - the waiting lane (SLURM_LANE): the Slurm tier, whose tests spend their time waiting on slurmctld's
#    scheduling ticks and signal delays, and the node and sandbox tests, which spend more than half theirs
#    waiting on heartbeats, stalls, limits and timeouts (PRORL_CPU_REPORT's CPU against --durations' wall
#    time), so it leaves most of the CPU to the other two lanes (with the CPU-bound tests/domains moved into
#    it instead, CI on the 2-core VM took 2,466 s, not 2,056: the model lane ran alone for its last nine
#    minutes);
#  - the model lane (MODEL_LANE): vLLM and torch on the CPU, the training examples, the chaos runs (the SWE
#    and image tests, which it held too, made it the last lane to end: 1,738 s against the rest's 1,330 s);
#  - the rest, which alone keeps one of two cores busy: it waits on process starts, sandboxes and signals.
# Every test's process checks look only at what it started (its pids, its PRORL_HOME), so the lanes
# cannot see each other's processes. Each lane's output is printed whole when all three have ended.
SLURM_LANE=(tests/slurm tests/node tests/sandbox)
MODEL_LANE=(tests/inference tests/training tests/chaos)
slurm_out="$(mktemp "${TMPDIR:-/tmp}/prorl-waiting-lane.XXXXXX")"
model_out="$(mktemp "${TMPDIR:-/tmp}/prorl-model-lane.XXXXXX")"
lane_pids=()
# Interrupted (Ctrl-C, a CI time limit's SIGTERM): stop the lanes this script started, and show what they printed.
stop_lanes() {
  trap - INT TERM
  for pid in "${lane_pids[@]}"; do
    # SIGINT: pytest stops as at Ctrl-C, tearing down what its tests started (tests/conftest.py gives a lane
    # started with `&` its SIGINT back).
    kill -INT "$pid" 2>/dev/null || true
  done
  wait || true
  echo "---------------- interrupted: what the lanes beside the rest printed ----------------"
  cat "$model_out" "$slurm_out"
  rm -f "$model_out" "$slurm_out"
  exit 130
}
trap stop_lanes INT TERM
PRORL_HOME="$(mktemp -d "${TMPDIR:-/tmp}/prorl-home.XXXXXX")" \
  "$venv/bin/python" -m pytest -ra "$@" "${SLURM_LANE[@]}" >"$slurm_out" 2>&1 &
slurm_pid=$!
lane_pids+=("$slurm_pid")
PRORL_HOME="$(mktemp -d "${TMPDIR:-/tmp}/prorl-home.XXXXXX")" \
  "$venv/bin/python" -m pytest -ra "$@" "${MODEL_LANE[@]}" >"$model_out" 2>&1 &
model_pid=$!
lane_pids+=("$model_pid")
ignore=()
for lane in "${SLURM_LANE[@]}" "${MODEL_LANE[@]}"; do
  ignore+=("--ignore=$lane")
done
rest=0
"$venv/bin/python" -m pytest -ra "$@" "${ignore[@]}" || rest=$?
model=0
wait "$model_pid" || model=$?
slurm=0
wait "$slurm_pid" || slurm=$?
trap - INT TERM
echo "---------------- the model lane (run beside the rest; exit $model) ----------------"
cat "$model_out"
echo "---------------- the waiting lane: the Slurm tier, node and sandbox tests (run beside the rest; exit $slurm) ----------------"
cat "$slurm_out"
rm -f "$slurm_out" "$model_out"
if [ "$filtered" = 1 ] && { [ "$rest" = 0 ] || [ "$model" = 0 ] || [ "$slurm" = 0 ]; }; then
  # A filter (-k, -m) may leave a lane nothing to run (exit 5); the whole suite never does.
  for lane in rest model slurm; do
    if [ "${!lane}" = 5 ]; then printf -v "$lane" 0; fi
  done
fi
for status in "$rest" "$model" "$slurm"; do
  if [ "$status" != 0 ]; then exit "$status"; fi
done
exit 0
