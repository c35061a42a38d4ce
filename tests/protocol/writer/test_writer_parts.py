"""The writer is one `Publisher` composed of small parts (`sparsesync.protocol.writer`): typed
keyword options that are exactly `PublisherConfig`'s, no class swapped in from `__new__`, no part
importing another's private names or the facade above it, each module documented and small."""

from __future__ import annotations

import ast
import dataclasses
import inspect
from pathlib import Path

import pytest

import sparsesync
from sparsesync.errors import ConfigError
from sparsesync.protocol.writer.config import PublisherConfig
from sparsesync.protocol.writer.publisher import Publisher

PROTOCOL = Path(sparsesync.__file__).parent / "protocol"
WRITER = sorted((PROTOCOL / "writer").glob("*.py"))


def test_every_option_is_a_typed_documented_keyword_with_the_configs_default():
    params = inspect.signature(Publisher).parameters
    assert not [p for p in params.values() if p.kind is p.VAR_KEYWORD], "no **overrides hiding options"
    for f in dataclasses.fields(PublisherConfig):
        p = params[f.name]
        assert p.kind is p.KEYWORD_ONLY and p.default == f.default, f.name
        assert p.annotation not in (inspect.Parameter.empty, "Any"), f.name
        assert f"    {f.name} (`" in (Publisher.__doc__ or ""), f"{f.name} is not in the Args of Publisher"


def test_a_publisher_is_one_class_and_refuses_options_before_claiming_the_run(tmp_path):
    with Publisher(str(tmp_path / "run"), anchor_every=3, queue_size=2) as pub:
        assert type(pub) is Publisher and (pub.rank, pub.world) == (0, 1)
        assert (pub.config.anchor_every, pub.config.queue_size) == (3, 2)
    with pytest.raises(ConfigError, match="queue_size=0"):
        Publisher(str(tmp_path / "other"), queue_size=0)
    assert not (tmp_path / "other" / "writers").exists()


@pytest.mark.parametrize("path", WRITER, ids=lambda p: p.name)
def test_each_writer_module_is_documented_small_and_imports_no_private_names(path):
    text = path.read_text()
    tree = ast.parse(text)
    assert ast.get_docstring(tree), "a module docstring saying what it guarantees"
    assert len(text.splitlines()) < 450
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sparsesync"):
            assert not [a.name for a in node.names if a.name.startswith("_")], f"{node.module}: private names"
            if path.name != "publisher.py":
                assert node.module != "sparsesync.protocol.writer.publisher", "a part imports the facade above it"
        if isinstance(node, ast.FunctionDef):
            assert node.name != "__new__", "nothing is returned from __new__"
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            assert node.func.id != "super", "parts are composed, not overridden"
