#!/usr/bin/env bash
# Publish a few versions of a model through a temporary local bucket, follow them, show the run;
# the bucket is removed at the end (its path is printed).
set -euo pipefail
cd "$(dirname "$0")/.."
bucket=$(mktemp -d "${TMPDIR:-/tmp}/sparsesync-bucket-XXXX")
trap 'rm -rf "$bucket" && echo "removed the temporary bucket $bucket"' EXIT
.venv/bin/python scripts/quickstart.py "$bucket"
.venv/bin/sparsesync log "$bucket/runs/quickstart"
.venv/bin/sparsesync verify "$bucket/runs/quickstart"
