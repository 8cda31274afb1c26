#!/usr/bin/env bash
# Validates and benchmarks the cuda backend on a machine with an NVIDIA GPU.
#
#   scripts/gpu-validate.sh                     # writes to $OUT, or ./gpu-validate-out
#   STEPS="tests pin" scripts/gpu-validate.sh   # a subset of: tests bench copy pin
#
# Steps, each under its own time limit (about 12 min in all; a typical run is far shorter):
#   tests  pytest -m cuda -v tests (every GPU test), then the CPU tests of the cuda backend's
#          logic (pool scheduling, handle encoding, copy plans, import guard)
#   bench  cachexferd bench swap --backend cuda ($BENCH_ARGS; results under $OUT/bench)
#   copy   scripts/cuda_copy_probe.py: dma vs staging vs a raw pinned copy -> the auto rule
#   pin    scripts/pin_probe.py: pinning 64 GiB, its time, status latency meanwhile
# Output in $OUT: summary.txt (environment and each step's exit code), pytest-cuda.log,
# bench.log, bench/ (the bench's own files), probes.log, copy_probe.json, pin_probe.json.
#
# Needs torch with CUDA, msgpack, uvloop, prometheus-client, pytest and cuda-bindings. If
# pyzmq is missing and its wheel sits in .whl/, it is installed from there into /tmp/site.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu-validate-out}"
mkdir -p "$OUT/bench"
PY="${PYTHON:-python3}"
STEPS="${STEPS:-tests bench copy pin}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

if ! "$PY" -c "import zmq" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi

SUMMARY="$OUT/summary.txt"
{
  echo "# gpu-validate $(date -u +%Y-%m-%dT%H:%M:%SZ) at $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
  nvidia-smi --query-gpu=name,uuid,driver_version,memory.total,pci.bus_id --format=csv,noheader 2>&1
  "$PY" - <<'EOF' 2>&1
import importlib.util, platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda)
print("cuda available", torch.cuda.is_available(), "devices", torch.cuda.device_count())
for name in ("cuda.bindings", "zmq", "msgpack", "uvloop", "prometheus_client", "pytest_timeout"):
    try:
        found = importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        found = False
    print(f"{name}: {'yes' if found else 'MISSING'}")
EOF
  echo "numa nodes: $(ls -d /sys/devices/system/node/node* 2>/dev/null | wc -l); memlock: $(ulimit -l)"
} >"$SUMMARY"

step() {  # step NAME LIMIT_S LOG COMMAND...
  local name="$1" limit="$2" log="$3"
  shift 3
  case " $STEPS " in *" $name "*) ;; *) return 0 ;; esac
  local started=$SECONDS
  timeout --kill-after=10 "$limit" "$@" >>"$log" 2>&1
  local rc=$?
  echo "step $name: exit $rc after $((SECONDS - started))s (limit ${limit}s): $*" | tee -a "$SUMMARY"
}

step tests 240 "$OUT/pytest-cuda.log" "$PY" -m pytest -p no:cacheprovider -v -rs --timeout 200 -m cuda tests
step tests 60 "$OUT/pytest-cuda.log" "$PY" -m pytest -p no:cacheprovider -q tests/unit/test_cuda_ipc_encoding.py \
  tests/unit/test_cuda_pool_logic.py tests/unit/test_cuda_copy_plan.py tests/unit/test_import_guard.py
# shellcheck disable=SC2086  # BENCH_ARGS is a list of words on purpose
step bench 150 "$OUT/bench.log" "$PY" -m cachexferd bench swap ${BENCH_ARGS:---backend cuda --json $OUT/bench/swap.json}
step copy 110 "$OUT/probes.log" "$PY" scripts/cuda_copy_probe.py --out "$OUT/copy_probe.json"
step pin 150 "$OUT/probes.log" "$PY" scripts/pin_probe.py --capacity 64GiB --chunk 1GiB --out "$OUT/pin_probe.json"

grep -E "passed|failed|error" "$OUT/pytest-cuda.log" | tail -3 >>"$SUMMARY" 2>/dev/null
cat "$SUMMARY"
! grep -q "exit [^0]" "$SUMMARY"
