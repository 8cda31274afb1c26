#!/usr/bin/env bash
# Validates and benchmarks the cuda backend on a machine with an NVIDIA GPU, in one go.
#
#   scripts/gpu-validate.sh [--wheels DIR] [--out DIR] [--anchors DIR] [--steps "tests bench ..."]
#   scripts/gpu-validate.sh --fetch-wheels DIR     # on a machine with PyPI: the wheels a bare GPU image lacks
#
# Steps (default "probe tests bench anchors pin": under 8 minutes, each under its own time
# limit; STEPS or --steps picks some; PYTEST_WORKERS, default 6, runs the GPU tests in parallel
# where pytest-xdist is installed):
#   probe    scripts/gpu_fastpath_probe.py: driver call costs on the loop's thread, a lone
#            swap's fixed cost and stage times (polling and watcher), swap-in grids beside a
#            GEMM, driver calls while the pool pins
#   tests    pytest -m cuda on every test file with GPU tests (exactness of every copy method,
#            IPC through daemons, the vLLM layouts' CUDA attach; the CPU tests of the backend's
#            logic run in CI)
#   bench    cachexferd bench swap --backend cuda --preset vllm (pieces 4/16/32 KiB, 1..1024
#            scattered blocks, d2h/h2d/both, every copy method; raw references warmed), then
#            4 swaps in flight per direction (16..128 blocks, auto and kernel)
#   anchors  the reference scripts (anchor_kernel.py, anchor_duplex.py) from --anchors
#            (default ../shared/gpu/h100-2026-11-25 or shared/gpu/h100-2026-11-25), run beside
#            the bench in the same session; skipped when absent
#   copy     scripts/cuda_copy_probe.py: every method vs a warmed raw pinned copy, 1 GiB swaps
#            (not in the default steps)
#   pin      scripts/pin_probe.py: pinning $PIN_CAPACITY (default 64GiB), status latency meanwhile
#
# Output in --out (default $OUT or ./gpu-validate-out): summary.txt (environment, each step's
# exit code and time, pytest counts, and scripts/gpu_summary.py's table: bench rows per method
# beside the anchors and the targets, comparable with shared/gpu/h100-2026-11-25/summary.txt),
# pytest-cuda.log, bench.log, bench/swap.json, anchors/*.jsonl, probes.log, copy_probe.json,
# pin_probe.json.
#
# Needs python3 with the CUDA build of torch (which brings Triton). pyzmq, msgpack, msgspec,
# numpy, uvloop, prometheus-client, pytest, pytest-timeout and pytest-xdist are installed from --wheels DIR when missing
# (into /tmp/cx-site, put on PYTHONPATH so every subprocess, the tests' included, sees them).
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
OUT="${OUT:-$PWD/gpu-validate-out}"
STEPS="${STEPS:-probe tests bench anchors pin}"
WHEELS="${WHEELS:-}"
ANCHORS="${ANCHORS:-}"
PIN_CAPACITY="${PIN_CAPACITY:-64GiB}"
NEEDED="pyzmq msgpack msgspec numpy uvloop prometheus-client pytest pytest-timeout pytest-xdist execnet"

while [ $# -gt 0 ]; do
  case "$1" in
    --wheels) WHEELS="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    --steps) STEPS="$2"; shift 2 ;;
    --anchors) ANCHORS="$2"; shift 2 ;;
    --fetch-wheels)
      # shellcheck disable=SC2086  # NEEDED is a list of words
      exec "$PY" -m pip download --only-binary=:all: --python-version "${PY_VERSION:-3.12}" \
        --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 --dest "$2" $NEEDED ;;
    -h|--help) sed -n '2,30p' "$0"; exit 0 ;;
    *) echo "unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
mkdir -p "$OUT/bench" "$OUT/anchors"
BEGAN=$SECONDS
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

missing_modules() {
  "$PY" - <<'EOF'
import importlib.util
wanted = {"zmq": "pyzmq", "msgpack": "msgpack", "msgspec": "msgspec", "numpy": "numpy", "uvloop": "uvloop",
          "prometheus_client": "prometheus-client", "pytest": "pytest", "pytest_timeout": "pytest-timeout",
          "xdist": "pytest-xdist", "execnet": "execnet"}
print(" ".join(pkg for mod, pkg in wanted.items() if importlib.util.find_spec(mod) is None))
EOF
}

missing=$(missing_modules)
if [ -n "$missing" ]; then
  if [ -n "$WHEELS" ] && [ -d "$WHEELS" ]; then
    # shellcheck disable=SC2086  # a list of package names
    "$PY" -m pip install -q --no-index --find-links "$WHEELS" --no-compile --target /tmp/cx-site $missing
    export PYTHONPATH="$PYTHONPATH:/tmp/cx-site"
    missing=$(missing_modules)
  fi
  [ -n "$missing" ] && echo "missing: $missing (give --wheels DIR; make one with --fetch-wheels DIR)" >&2
fi

if [ -z "$ANCHORS" ]; then
  for dir in ../shared/gpu/h100-2026-11-25 shared/gpu/h100-2026-11-25; do
    [ -f "$dir/anchor_kernel.py" ] && ANCHORS="$dir" && break
  done
fi

SUMMARY="$OUT/summary.txt"
{
  echo "# gpu-validate $(date -u +%Y-%m-%dT%H:%M:%SZ) at $(git rev-parse --short HEAD 2>/dev/null || echo '?') steps: $STEPS"
  nvidia-smi --query-gpu=name,uuid,driver_version,memory.total,pci.bus_id --format=csv,noheader 2>&1
  "$PY" - <<'EOF' 2>&1
import importlib.util, os, platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda)
print("cuda available", torch.cuda.is_available(), "devices", torch.cuda.device_count())
for name in ("triton", "cuda.bindings", "zmq", "msgpack", "msgspec", "numpy", "uvloop", "prometheus_client",
             "pytest_timeout"):
    try:
        found = importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        found = False
    print(f"{name}: {'yes' if found else 'MISSING'}")
print("load average", " ".join(f"{x:.2f}" for x in os.getloadavg()), "cpus", os.cpu_count())
EOF
  echo "numa nodes: $(ls -d /sys/devices/system/node/node* 2>/dev/null | wc -l); memlock: $(ulimit -l)"
  echo "anchors: ${ANCHORS:-none found}"
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

mapfile -t GPU_TESTS < <(grep -rl --include='test_*.py' -e 'pytest.mark.cuda' tests)
# The GPU tests start many CUDA daemons; with pytest-xdist they run PYTEST_WORKERS at a time,
# except those marked "alone" (they read the GPU's device-wide free memory), run afterwards.
XDIST=()
if "$PY" -c "import xdist" 2>/dev/null && [ "${PYTEST_WORKERS:-6}" -gt 1 ]; then
  XDIST=(-n "${PYTEST_WORKERS:-6}")
fi
step probe 70 "$OUT/probe.log" "$PY" scripts/gpu_fastpath_probe.py --out "$OUT/probe.jsonl"
step tests 130 "$OUT/pytest-cuda.log" "$PY" -m pytest -p no:cacheprovider -v -rs --timeout 120 "${XDIST[@]}" \
  -m "cuda and not alone" "${GPU_TESTS[@]}"
step tests 45 "$OUT/pytest-cuda.log" "$PY" -m pytest -p no:cacheprovider -v -rs --timeout 40 -m "cuda and alone" \
  "${GPU_TESTS[@]}"
step bench 60 "$OUT/bench.log" "$PY" -m cachexferd bench swap --backend cuda --preset vllm --min-time 0.05 \
  --json "$OUT/bench/swap.json"
step bench 30 "$OUT/bench.log" "$PY" -m cachexferd bench swap --backend cuda --preset vllm --counts 16,128 \
  --in-flight 4 --methods auto,kernel --min-time 0.05 --json "$OUT/bench/swap-inflight.json"
if [ -n "$ANCHORS" ]; then
  for anchor in anchor_kernel anchor_duplex; do
    [ -f "$ANCHORS/$anchor.py" ] || continue
    step anchors 35 "$OUT/anchors/$anchor.jsonl" "$PY" "$ANCHORS/$anchor.py"
  done
fi
step copy 120 "$OUT/probes.log" "$PY" scripts/cuda_copy_probe.py --out "$OUT/copy_probe.json"
step pin 40 "$OUT/probes.log" "$PY" scripts/pin_probe.py --capacity "$PIN_CAPACITY" --chunk 1GiB \
  --limit-s 30 --out "$OUT/pin_probe.json"

{
  echo "all steps: $((SECONDS - BEGAN))s"
  grep -E "(passed|failed|error|skipped|deselected).* in [0-9.]+s" "$OUT/pytest-cuda.log" 2>/dev/null
  "$PY" scripts/gpu_summary.py "$OUT"
} >>"$SUMMARY" 2>&1
cat "$SUMMARY"
! grep -q "exit [^0]" "$SUMMARY"
