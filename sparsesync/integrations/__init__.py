"""Engine integrations: what any user of an inference engine needs to follow a sparsesync run.

`sparsesync.integrations.vllm`: the vLLM plugin, weight-transfer backend, apply and engine-side
check. `sparsesync.integrations.trl`: TRL's trainers publishing through sparsesync
(`callback`: `SparsesyncCallback`, `SparsesyncWeightTransfer`; needs `transformers`), a drop-in
for TRL's vLLM client in `GRPOTrainer` server mode (`client`: `sparsesync_server_mode`) and TRL's
async GRPO rollout worker on sparsesync replicas (`rollout`: `follow_replicas`; both need `trl`).
Both packages re-export their public names. Importing this package (or `trl`, `vllm` under it)
imports no engine and no trainer library.
"""

import warnings

_TRL_VLLM_WARNING = r"TRL currently supports vLLM versions"
_quieted = False


def quiet_trl_vllm_warning() -> None:
    """Show TRL's "TRL currently supports vLLM versions ..." warning at most once per process.

    TRL warns from every module that checks the vLLM version (about 8 times per import), and
    Python's "once" filter counts per module. So this runs TRL's check once, shows what it warned
    (if anything) once, and ignores the message from then on. The TRL integrations call it
    before they import TRL; needs `trl` (a no-op without it)."""
    global _quieted
    if _quieted:
        return
    _quieted = True
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            from trl.import_utils import is_vllm_available

            is_vllm_available()
    except ImportError:
        return
    shown = [w for w in caught if str(w.message).startswith(_TRL_VLLM_WARNING)]
    if shown:
        warnings.warn_explicit(shown[0].message, shown[0].category, shown[0].filename, shown[0].lineno)
    warnings.filterwarnings("ignore", message=_TRL_VLLM_WARNING, category=UserWarning)
