"""`make_engine`'s one table: an engine for every kind and both kinds of run (full weights, LoRA
adapter), each row an `Engine` whose constructor takes `adapter=` exactly on the adapter rows,
and one message for a kind the table lacks, whichever the run."""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import pytest

from inference_space.engines import _TABLE, ENGINES, Engine, make_engine
from sparsesync.errors import ConfigError
from sparsesync.lora.meta import AdapterMeta


def test_every_kind_has_an_engine_for_both_kinds_of_run() -> None:
    assert set(_TABLE) == {(kind, adapter) for kind in ENGINES for adapter in (False, True)}
    for (kind, adapter), home in _TABLE.items():
        module, name = home.split(":")
        engine = getattr(importlib.import_module(module), name)  # the vLLM modules import vllm only when started
        assert issubclass(engine, Engine), home
        assert ("adapter" in inspect.signature(engine.__init__).parameters) is adapter, home


@pytest.mark.parametrize("adapter", [None, AdapterMeta("base", "0" * 16, {"peft_type": "LORA", "r": 4}, "float32")])
def test_an_unknown_kind_is_one_message_for_both_kinds_of_run(tmp_path: Path, adapter: AdapterMeta | None) -> None:
    with pytest.raises(ConfigError, match=r"^engine 'tgi': unknown, expected one of embedded, vllm$"):
        make_engine("tgi", tmp_path, adapter=adapter)
