#!/usr/bin/env bash
# The GPU benchmarks (bench/gpu_planning.py, gpu_vla.py, gpu_caption.py, gpu_vlm.py, gpu_video.py,
# gpu_vllm_rollout.py, and ddp_scaling.py --fsdp --device cuda where 2 GPUs are visible) as one prepared command
# for the `device` tool's machine: one H200 with torch 2.11 + CUDA, no network, 64 MiB carried.
#
#   bash bench/gpu_session.sh fetch     # here, after the last code change: fills .whl/ and .gl/
#   device run, carry [".whl", ".gl"], timeout_s 600:   bash bench/gpu_session.sh run
#   bash bench/gpu_session.sh smoke     # here: the same sequence at tiny sizes on the CPU
#
# `fetch` puts mmrl's own wheel and the packages that machine's image lacks or holds in another
# version (transformers, gymnasium, mujoco, qwen-vl-utils, ...; versions taken from this venv, so
# the GPU runs the stack the tests ran) into .whl/ (~25 MB), and the GL loaders MuJoCo's EGL
# rendering needs into .gl/. LIBERO does not travel (robosuite alone is ~590 MB), so the VLA bench
# runs on the MuJoCo tabletop there. `run` writes each bench's log and the JSON line it ends with
# to $OUT (results.json gathers them); every bench has its own time limit, so one that hangs
# leaves the others' figures.
set -uo pipefail
cd "$(dirname "$0")/.."
mode=${1:-}
OUT=${OUT:-runs/gpu_session}
PY=python3
[ -x .venv/bin/python ] && [ "$mode" != run ] && PY=.venv/bin/python
PY=${PYTHON:-$PY}
# What the image lacks (or holds in another version) among the benches' imports.
PACKAGES=(transformers tokenizers gymnasium farama-notifications mujoco glfw pyopengl etils qwen-vl-utils diffusers)
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64)

fetch() {
  set -e
  for d in /.whl/ /.gl/; do grep -qxF "$d" .git/info/exclude 2>/dev/null || echo "$d" >> .git/info/exclude; done
  rm -rf .whl .gl && mkdir -p .whl .gl
  "$PY" -m pip wheel -q --no-deps -w .whl .
  local pins=()
  for p in "${PACKAGES[@]}"; do
    pins+=("$p==$("$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$p")")
  done
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]/#/--platform=}" -d .whl "${pins[@]}"
  local lists
  lists=$(mktemp -d)  # apt's package lists for amd64, apart from this machine's own
  local o=(-oAPT::Architecture=amd64 -oAPT::Architectures=amd64 -oDir::State::Lists="$lists")
  mkdir -p "$lists/partial"
  apt-get "${o[@]}" update -qq
  (cd .gl && apt-get "${o[@]}" download libvulkan1 libegl1 libglvnd0 libopengl0 libgl1 libglx0 libgles2 2>/dev/null)
  du -sh .whl .gl
}

# bench NAME SECONDS SCRIPT ARGS...: run one bench under a time limit; keep its log and last JSON line.
bench() {
  local name=$1 limit=$2; shift 2
  echo "== $name (limit ${limit}s): $*"
  timeout --kill-after=10 "$limit" "$PY" "$@" 2>&1 | tee "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  [ "$rc" = 0 ] || echo "!! $name exited with $rc"
}

gather() {
  "$PY" - "$OUT" <<'EOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
results = {}
for log in sorted(out.glob("*.log")):
    lines = [x for x in log.read_text(errors="replace").splitlines() if x.startswith("{")]
    try:
        results[log.stem] = json.loads(lines[-1]) if lines else {"error": "no JSON line (see the log)"}
    except json.JSONDecodeError as e:
        results[log.stem] = {"error": f"last JSON line unreadable: {e}"}
(out / "results.json").write_text(json.dumps(results, indent=1))
print(json.dumps(results))
EOF
}

case "$mode" in
  fetch) fetch ;;
  run)
    [ -d .whl ] || { echo "no .whl/: run 'bash bench/gpu_session.sh fetch' here and carry .whl and .gl" >&2; exit 2; }
    for f in .gl/*.deb; do [ -e "$f" ] && dpkg -x "$f" /; done
    ldconfig 2>/dev/null || true
    scratch=$(mktemp -d)  # installed packages and the benches' run folders, off the working tree
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$scratch/site" .whl/*.whl || exit 2
    export PYTHONPATH="$scratch/site" PYTHONUNBUFFERED=1 MUJOCO_GL=egl PYOPENGL_PLATFORM=egl
    vendor=/usr/local/nvidia/share/glvnd/egl_vendor.d/10_nvidia.json  # the driver's EGL, for libglvnd
    [ -e "$vendor" ] && export __EGL_VENDOR_LIBRARY_FILENAMES=$vendor
    mkdir -p "$OUT"
    nvidia-smi -L | tee "$OUT/device.txt"
    # ~9 min in all: budget + model build, VQ training and two evaluations per planning env.
    bench planning_frozenlake 180 bench/gpu_planning.py --envs frozenlake --minutes 1.25 --out "$scratch/gpu_planning"
    bench planning_maze 180 bench/gpu_planning.py --envs maze --minutes 1.25 --out "$scratch/gpu_planning"
    bench vla_tabletop 110 bench/gpu_vla.py --env tabletop --steps 2 --output-dir "$scratch/gpu_vla"
    bench caption 90 bench/gpu_caption.py --steps 2 --out "$scratch/gpu_caption"
    bench vlm 150 bench/gpu_vlm.py --steps 2
    bench video 90 bench/gpu_video.py
    # Multi-GPU training: 1 and 2 nccl ranks with the policy sharded by FSDP2 (ddp_scaling launches
    # its own torchrun for each world size). A skip leaves a JSON line saying why.
    ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
    if [ "${ngpu:-0}" -ge 2 ]; then
      bench ddp_fsdp_gpu 150 bench/ddp_scaling.py --fsdp --device cuda
    else
      echo "== ddp_fsdp_gpu: skipped, a 2-process FSDP step needs 2 GPUs (${ngpu:-0} visible)"
      echo "{\"skipped\": \"needs 2 GPUs, ${ngpu:-0} visible\"}" > "$OUT/ddp_fsdp_gpu.log"
    fi
    # vLLM against the HF sampler (vllm does not travel in .whl: it runs where the image has it; the
    # bench's JSON says so otherwise), and the engine's own test where it can run.
    bench vllm_rollout 300 bench/gpu_vllm_rollout.py
    if "$PY" -c "import vllm, pytest" 2>/dev/null; then
      timeout 300 "$PY" -m pytest -q -p no:cacheprovider tests/test_vllm_engine.py 2>&1 | tee "$OUT/vllm_engine_test.txt"
    else
      echo "== vllm engine test: skipped, vllm or pytest does not import on this machine"
    fi
    gather ;;
  smoke)
    mkdir -p "$OUT"
    bench planning 300 bench/gpu_planning.py --smoke --out "$OUT/planning"
    bench vla_tabletop 300 bench/gpu_vla.py --smoke --output-dir "$OUT/vla"
    bench caption 300 bench/gpu_caption.py --smoke --out "$OUT/caption"
    bench vlm 300 bench/gpu_vlm.py --smoke
    bench video 300 bench/gpu_video.py --smoke
    bench vllm_rollout 300 bench/gpu_vllm_rollout.py --smoke
    gather ;;
  *) echo "usage: bash bench/gpu_session.sh fetch | run | smoke" >&2; exit 2 ;;
esac
