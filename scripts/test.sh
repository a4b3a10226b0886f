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
# Slurm lane (tests/slurm, tests/chaos), the waiting lane (tests/node, tests/sandbox, tests/swe, tests/client)
# and the model lane (vLLM, training) in pytests of their own beside the rest (CI does); given a test path, it
# runs one pytest, and a -k/-m filter may leave a lane with nothing to run.
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
# PRORL_LANES=1 (CI): the suite runs as four pytests side by side, each with a home of its own:
#  - the Slurm lane (SLURM_LANE): the Slurm tier, whose tests spend their time waiting on slurmctld's
#    scheduling ticks and signal delays (about 100 CPU-seconds in 950 s of wall time), and the chaos runs
#    (in the model lane, which ended last at 1,284 s while this one ended at 949 s);
#  - the waiting lane (WAITING_LANE): the node and sandbox tests, which spend more than half their time
#    waiting on heartbeats, stalls, limits and timeouts (PRORL_CPU_REPORT's CPU against --durations' wall
#    time), and the SWE and client tests, which wait on sandboxes and brokers. With the Slurm tier in the same
#    pytest, that lane was the last to end (1,502 s) while the machine's two cores were 30 % idle;
#  - the model lane (MODEL_LANE): vLLM and torch on the CPU, the training examples (the SWE and image tests,
#    which it held too, made it the last lane to end: 1,738 s against the rest's 1,330 s);
#  - the rest, which alone keeps one of two cores busy: it waits on process starts, sandboxes and signals.
# (With the CPU-bound tests/domains in a waiting lane instead, CI on the 2-core VM took 2,466 s, not 2,056: the
# model lane ran alone for its last nine minutes.) Every test's process checks look only at what it started
# (its pids, its PRORL_HOME), so the lanes cannot see each other's processes. Each lane's output is printed
# whole when all have ended.
SLURM_LANE=(tests/slurm tests/chaos)
WAITING_LANE=(tests/node tests/sandbox tests/swe tests/client)
MODEL_LANE=(tests/inference tests/training)
LANES=(slurm waiting model)
declare -A lane_out lane_pid lane_title
lane_title[slurm]="the Slurm lane: the Slurm tier and the chaos runs"
lane_title[waiting]="the waiting lane: node, sandbox, SWE and client tests"
lane_title[model]="the model lane: vLLM and training"
lane_pids=()
for lane in "${LANES[@]}"; do
  lane_out[$lane]="$(mktemp "${TMPDIR:-/tmp}/prorl-$lane-lane.XXXXXX")"
done
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
  for lane in "${LANES[@]}"; do
    cat "${lane_out[$lane]}"
    rm -f "${lane_out[$lane]}"
  done
  exit 130
}
trap stop_lanes INT TERM
ignore=()
for lane in "${LANES[@]}"; do
  declare -n dirs="${lane^^}_LANE"
  PRORL_HOME="$(mktemp -d "${TMPDIR:-/tmp}/prorl-home.XXXXXX")" \
    "$venv/bin/python" -m pytest -ra "$@" "${dirs[@]}" >"${lane_out[$lane]}" 2>&1 &
  lane_pid[$lane]=$!
  lane_pids+=("$!")
  for dir in "${dirs[@]}"; do
    ignore+=("--ignore=$dir")
  done
  unset -n dirs
done
rest=0
"$venv/bin/python" -m pytest -ra "$@" "${ignore[@]}" || rest=$?
declare -A lane_status
for lane in "${LANES[@]}"; do
  lane_status[$lane]=0
  wait "${lane_pid[$lane]}" || lane_status[$lane]=$?
done
trap - INT TERM
for lane in "${LANES[@]}"; do
  echo "---------------- ${lane_title[$lane]} (run beside the rest; exit ${lane_status[$lane]}) ----------------"
  cat "${lane_out[$lane]}"
  rm -f "${lane_out[$lane]}"
done
statuses=("$rest")
for lane in "${LANES[@]}"; do
  statuses+=("${lane_status[$lane]}")
done
if [ "$filtered" = 1 ]; then
  # A filter (-k, -m) may leave a lane nothing to run (exit 5); the whole suite never does.
  all_empty=1
  for status in "${statuses[@]}"; do
    if [ "$status" != 5 ]; then all_empty=0; fi
  done
  if [ "$all_empty" = 0 ]; then
    for i in "${!statuses[@]}"; do
      if [ "${statuses[$i]}" = 5 ]; then statuses[$i]=0; fi
    done
  fi
fi
for status in "${statuses[@]}"; do
  if [ "$status" != 0 ]; then exit "$status"; fi
done
exit 0
