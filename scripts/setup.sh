#!/usr/bin/env bash
# Set up sparsesync on a fresh machine: a virtual environment in .venv with the library, the apps
# and everything the tests need (vLLM's CPU build included), at exactly the versions of
# requirements/lock.txt (installed without a resolver, so two set-ups get the same packages;
# `bash scripts/lock.sh` regenerates the lock, deliberately). For Linux x86-64 and Python 3.11.
# torch's CPU build comes from a local wheel folder where pip has one, else from PyTorch's CPU
# wheel index (torch only); everything else from the package index.
# Usage: bash scripts/setup.sh   (idempotent; measured from scratch: see README's Quickstart)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_pip.sh
PY=${PYTHON:-python3}
LOCK=requirements/lock.txt
if ! "$PY" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
  echo "requirements/lock.txt is for Python 3.11 ($PY is $("$PY" -V 2>&1)): set PYTHON=python3.11" >&2
  exit 1
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=.venv/bin/pip
pip_q "$PIP" install -q "$(grep -E '^pip==' "$LOCK")"
install_torch "$PIP" "$(grep -E '^torch==' "$LOCK")"
pip_q "$PIP" install -q --no-deps -r "$LOCK"
# the project itself (editable; compiles the codec's C passes with the locked setuptools)
out=$(pip_q "$PIP" install -q --no-deps --no-build-isolation -e . 2>&1) || { echo "$out" >&2; exit 1; }
# (setuptools' editable-install banner is noise here; anything else is shown)
echo "$out" | grep -vE "^\s*$|BuildBackendWarning|!!|\*{8}|Please be careful|name as your package|take precedence|wheel_obj" || true
.venv/bin/python -c 'import sparsesync.codec._native' 2>/dev/null || { echo "the codec's C extension did not build" >&2; exit 1; }
# A .venv made earlier may hold packages the lock does not: remove them (same set everywhere).
extra=$(comm -23 <("$PIP" freeze --exclude-editable | sed -E 's/[=@ ].*//' | tr 'A-Z_' 'a-z-' | sort -u) \
                 <(grep -vE '^#' "$LOCK" | sed -E 's/[=@ ].*//' | tr 'A-Z_' 'a-z-' | sort -u))
if [ -n "$extra" ]; then echo "removing packages not in the lock: $(echo $extra)"; pip_q "$PIP" uninstall -q -y $extra; fi
check_env "$PIP" || { echo "requirements/lock.txt does not fit pyproject.toml: run bash scripts/lock.sh (and the tests), commit the lock" >&2; exit 1; }
.venv/bin/python -c 'import openenv.core.env_server.http_server'
.venv/bin/python -c 'import vllm, transformers, huggingface_hub, sparsesync; print("vllm", vllm.__version__, "transformers", transformers.__version__, "huggingface_hub", huggingface_hub.__version__)'
echo "sparsesync set up in .venv ($(.venv/bin/python -c 'import torch, sparsesync; print("torch", torch.__version__)'))"
