#!/usr/bin/env bash
# Publish a few versions of a model through a local bucket, follow them, and show the run.
set -euo pipefail
cd "$(dirname "$0")/.."
bucket=$(mktemp -d /tmp/sparsesync-bucket-XXXX)
.venv/bin/python scripts/quickstart.py "$bucket"
.venv/bin/sparsesync log "$bucket/runs/quickstart"
.venv/bin/sparsesync verify "$bucket/runs/quickstart"
