"""vLLM general plugin: registers the `sparsesync` weight-transfer backend in every vLLM process.

Loaded by vLLM through the `vllm.general_plugins` entry point `sparsesync` (pyproject.toml), so
`vllm serve MODEL --weight-transfer-config '{"backend": "sparsesync"}'` finds the backend;
`sparsesync.integrations.vllm.VllmEngine` (and the replica app) also call `register()` itself. Safe to call any number
of times, and it imports only vLLM's factory (the backend module is loaded lazily when an engine is created).

Following a run from vLLM's own server takes the endpoint plugin too (`server.py`), which vLLM
loads only when `VLLM_PLUGINS` names it. In vLLM's API-server process, with `SPARSESYNC_BUCKET`
set and `VLLM_PLUGINS` unset, `register()` refuses (`ConfigError`) rather than let the server
silently serve its startup weights forever.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Container, Mapping

from sparsesync.errors import ConfigError

BACKEND = "sparsesync"
_API_SERVER_MODULES = ("vllm.entrypoints.launchers.api_server.entry", "vllm.entrypoints.cli.serve")


def register() -> None:
    """Register `sparsesync` with vLLM's `WeightTransferEngineFactory` (idempotent)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            BACKEND, "sparsesync.integrations.vllm.backend", "SparsesyncWeightTransferEngine"
        )
    check_endpoint_enabled()


def check_endpoint_enabled(environ: Mapping[str, str] | None = None, modules: Container[str] | None = None) -> None:
    """In vLLM's API server: SPARSESYNC_BUCKET needs VLLM_PLUGINS naming `sparsesync`."""
    env = os.environ if environ is None else environ
    loaded = sys.modules if modules is None else modules
    if not (env.get("SPARSESYNC_BUCKET") or "").strip() or not any(m in loaded for m in _API_SERVER_MODULES):
        return
    allowed = env.get("VLLM_PLUGINS")
    if allowed is None or BACKEND not in allowed.split(","):
        raise ConfigError(
            f"SPARSESYNC_BUCKET={env['SPARSESYNC_BUCKET']} is set, but vLLM loads the sparsesync endpoint plugin "
            "(which makes the server follow it) only when VLLM_PLUGINS names it",
            hint="set VLLM_PLUGINS=sparsesync (add your other vLLM plugins, comma-separated)",
        )


# The entry points pyproject.toml declares, as a dist-info folder: a copy of sparsesync that is
# not pip-installed (the Space image copies the package) puts this folder on sys.path so vLLM's
# processes find both plugins. tests/integrations/vllm/test_serve.py checks it against pyproject.toml.
DIST_INFO = "sparsesync_vllm_plugins-0.dist-info"
ENTRY_POINTS = {
    "vllm.general_plugins": "sparsesync.integrations.vllm.plugin:register",
    "vllm.endpoint_plugins": "sparsesync.integrations.vllm.server:SparsesyncEndpoint",
}


def dist_info_files() -> dict[str, str]:
    """{path: text} of a minimal dist-info folder declaring `ENTRY_POINTS` (name `sparsesync`)."""
    eps = "".join(f"[{group}]\n{BACKEND} = {target}\n\n" for group, target in ENTRY_POINTS.items())
    return {
        f"{DIST_INFO}/METADATA": "Metadata-Version: 2.1\nName: sparsesync-vllm-plugins\nVersion: 0\n",
        f"{DIST_INFO}/entry_points.txt": eps,
    }
