#!/usr/bin/env bash
# Issue 26's GPU checks in one run, for a machine with one CUDA GPU and no network (such
# machines are lent for minutes: everything is prepared, each stage has its own time limit).
#
#   bench/device_checks.sh OUT_DIR          run them (from the repository's root)
#   bench/device_checks.sh --dry-run        print the stages' commands, run nothing
#
# Stages, in order, each writing to OUT_DIR (9 files, none in a subfolder):
#   build.log          the C extensions built in place for this python (setup.py build_ext)
#   gpu_tests.log      pytest -m gpu: the training loop under
#                      torch.cuda.set_sync_debug_mode("error"), the recorded read on CUDA
#   trainer_cost.json  deltastream bench trainer-cost --device cuda (B = 4096): the step with
#   trainer_cost.png   deltastream ÷ alone, tick p99, bytes/s (the same run's picture; its
#   trainer_cost.log   log, with a traceback if it failed); the tracker read every 10 steps,
#                      never read (its hooks alone), a 50 KB/s budget and publish_delta's
#                      rounds every 10 steps
#   demo.log           deltastream demo on CUDA and on the CPU, each at both devices' default
#                      batch (8,192 and 512), so the CUDA ÷ CPU examples/s compare like with like
#   trainer_cost_cpu.json, trainer_cost_cpu.log
#                      the same bench on this host's CPU (the training thread on one core,
#                      the worker and the broker on others): tracker-idle, the budget, rounds
#   summary.txt        the machine, then each stage's exit status and figures
#                      (bench/_device_summary.py)
#
# Needs python3 with a CUDA torch, numpy, msgpack, pytest, pytest-timeout, hypothesis and
# triton (the device image has them) and, where they are not installed, deltastream's other
# dependencies and the embedded broker as wheels in .whl/ (`make device-wheels` downloads
# them here for python 3.12; carry .whl).
#
# Knobs (environment):
#   DEVICE_CHECKS_TOTAL_S  the whole run's limit (540, inside a 600 s call): no stage outlasts
#                          it, and one that would start with under 15 s left is skipped
#   DEVICE_CHECKS_SCALE    every stage's own limit times this (1)
#   DEVICE_CHECKS_DEMO_S   training seconds per demo (20)
#   DEVICE_CHECKS_ROUNDS   trainer-cost's pairs per configuration (6)
#   DEVICE_CHECKS_DEVICE   cuda; cpu runs the same stages on the CPU (a rehearsal)
#   DEVICE_CHECKS_WHEELS   the folder of wheels installed first, where it holds any (.whl)
set -u

DRY=0
if [ "${1:-}" = "--dry-run" ]; then DRY=1; OUT=$(mktemp -d); trap 'rm -rf "$OUT"' EXIT; else
    OUT=${1:?usage: bench/device_checks.sh OUT_DIR | --dry-run}; fi
PY=${PYTHON:-python3}
SCALE=${DEVICE_CHECKS_SCALE:-1}
DEMO_S=${DEVICE_CHECKS_DEMO_S:-20}
ROUNDS=${DEVICE_CHECKS_ROUNDS:-6}
DEV=${DEVICE_CHECKS_DEVICE:-cuda}
TOTAL=${DEVICE_CHECKS_TOTAL_S:-540}
WHEELS=${DEVICE_CHECKS_WHEELS:-.whl}
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
[ "$DRY" = 1 ] || : > "$SUMMARY"

FAILED=0  # the exit status: 1 once a stage failed or was skipped

say() { echo "$*" | tee -a "$SUMMARY"; }
# summary lines made from a stage's records (bench/_device_summary.py), to both
summarize() { "$PY" -m bench._device_summary "$@" 2>&1 | tee -a "$SUMMARY"; }

# stage NAME LIMIT_S LOG COMMAND...: run COMMAND under a time limit, its output to LOG
stage() {
    local name=$1 limit=$2 log=$3; shift 3
    limit=$(awk -v s="$limit" -v k="$SCALE" 'BEGIN { printf "%d", s * k }')
    if [ "$DRY" = 1 ]; then echo "[$name, ${limit} s] $*"; return 0; fi
    local left=$((TOTAL - SECONDS))
    if [ "$left" -lt 15 ]; then
        say "$name: skipped, ${left} s left of ${TOTAL}"; FAILED=1; return 125
    fi
    [ "$limit" -le "$left" ] || limit=$left
    local t0=$SECONDS rc=0
    timeout --kill-after=10 "$limit" "$@" >> "$log" 2>&1 || rc=$?
    say "$name: exit $rc in $((SECONDS - t0)) s$([ $rc = 124 ] && echo " (over its ${limit} s limit)")"
    [ $rc = 0 ] || FAILED=1
    return $rc
}

if [ "$DRY" = 0 ]; then
    if compgen -G "$WHEELS/*.whl" > /dev/null; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/device-site "$WHEELS"/*.whl > "$OUT/build.log" 2>&1 \
            || { say "wheels: pip install failed (build.log)"; exit 1; }
        export PYTHONPATH=/tmp/device-site:${PYTHONPATH:-}
    fi
    export PYTHONPATH=$PWD:${PYTHONPATH:-}
    summarize machine
fi

stage build 90 "$OUT/build.log" \
    "$PY" setup.py -q build_ext --inplace --build-temp build/device

stage gpu-tests 180 "$OUT/gpu_tests.log" \
    "$PY" -m pytest -m gpu -q -p no:cacheprovider tests/deltastream \
    tests/integration/test_publisher.py
[ "$DRY" = 0 ] && [ -e "$OUT/gpu_tests.log" ] && say "  $(tail -n 1 "$OUT/gpu_tests.log")"

stage trainer-cost 150 "$OUT/trainer_cost.log" \
    "$PY" -m deltastream.cli bench trainer-cost --device "$DEV" --batches 4096 \
    --budgets 50000 --only tracker,tracker-idle,budget-50000,rounds-10 --no-sync --no-thread --rounds "$ROUNDS" \
    --json --out "$OUT"
if [ "$DRY" = 0 ] && [ -e "$OUT/trainer_cost.log" ]; then
    grep '^{' "$OUT/trainer_cost.log" > "$OUT/trainer_cost.json"
    summarize trainer-cost "$OUT/trainer_cost.json"
fi

DEMOS=$(mktemp -d)
for run in "$DEV 1 8192" "$DEV 1 512" "cpu 2 512" "cpu 2 8192"; do
    set -- $run
    stage "demo-$1-w$2-b$3" $((DEMO_S + 45)) "$OUT/demo.log" \
        "$PY" -m deltastream.cli demo --device "$1" --workers "$2" --batch-size "$3" \
        --duration "$DEMO_S" --progress off --out "$DEMOS/$1-w$2-b$3"
done
# examples/s of each run, and the device's against the CPU demo's (2 workers)
[ "$DRY" = 1 ] || summarize demo "$DEMOS" "$DEV"

# the same loop on this host's CPU, last: with cores to spare for the worker and the broker
# (the 2-core CI machine has one), does publish_delta's rounds stay within 1.05?
stage trainer-cost-cpu 120 "$OUT/trainer_cost_cpu.log" \
    "$PY" -m deltastream.cli bench trainer-cost --device cpu --batches 4096 \
    --budgets 50000 --only tracker-idle,budget-50000,rounds-10 --no-sync --no-thread \
    --rounds "$ROUNDS" --json --out "$DEMOS"
if [ "$DRY" = 0 ] && [ -e "$OUT/trainer_cost_cpu.log" ]; then
    grep '^{' "$OUT/trainer_cost_cpu.log" > "$OUT/trainer_cost_cpu.json"
    summarize trainer-cost "$OUT/trainer_cost_cpu.json"
fi
rm -rf "$DEMOS"
exit $FAILED
