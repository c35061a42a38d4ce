"""One writer interface: every mode implements `WriterMode`, and `Publisher` never asks which mode it is in.

Real publishers on a local folder; the sharded mode (which needs a process group to be built)
is checked by its class: every member of the protocol, with the protocol's parameters.
"""

from __future__ import annotations

import ast
import inspect
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import sparsesync.protocol.writer.publisher as publisher_module
from sparsesync import Publisher
from sparsesync.errors import ConfigError, PatchMismatchError
from sparsesync.protocol.run import Run
from sparsesync.protocol.writer.choice import Passive, Undecided
from sparsesync.protocol.writer.mode import Tally, WriterMode
from sparsesync.protocol.writer.ranks import Ranks
from sparsesync.protocol.writer.sharded import ShardedState
from sparsesync.protocol.writer.whole import WholeState

MODES = [WholeState, ShardedState, Passive, Undecided]
# what a branch on the mode would name: the mode, its classes, or what picks it
MODE_NAMES = {"_mode", "mode", "_decided", "_ranks", "ranks", "holds_shards", "_ctx", "_tally",
              *(m.__name__ for m in MODES)}


def protocol_members() -> dict[str, inspect.Signature | None]:
    """The protocol's members: methods with their signatures, properties as None."""
    out: dict[str, inspect.Signature | None] = {}
    for name, value in vars(WriterMode).items():
        if isinstance(value, property):
            out[name] = None
        elif inspect.isfunction(value) and not name.startswith("_"):
            out[name] = inspect.signature(value)
    return out


def test_the_protocol_is_what_publisher_uses():
    assert set(protocol_members()) == {"settle", "publish", "resume", "version_of", "continue_below", "upload",
                                       "state_digest"}


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.__name__)
def test_every_mode_has_every_member_of_the_protocol(mode):
    for name, sig in protocol_members().items():
        member = inspect.getattr_static(mode, name)
        if sig is None:
            assert isinstance(member, property), f"{mode.__name__}.{name} is not a property"
            continue
        params = list(inspect.signature(member).parameters)
        assert params == list(sig.parameters), f"{mode.__name__}.{name}{inspect.signature(member)} is not {name}{sig}"


def test_modes_are_writer_modes_at_run_time(tmp_path):
    state = {"w": torch.zeros(4, dtype=torch.bfloat16)}
    with Publisher(str(tmp_path / "run"), anchor_every=0) as pub:
        whole = pub._mode
        assert type(whole) is WholeState and isinstance(whole, WriterMode) and whole.settle(state) is whole
        assert pub.publish(state) == 0
        pub.flush()
        assert pub.committed_version == 0 and pub.metrics[-1]["kind"] == "anchor"
        # the other modes, on the same parts with a tally of their own (a rank of its own)
        ctx = replace(pub._ctx, tally=Tally(pub.store.url, newest=None, adapter=None, committed=None, last=None))
        passive, undecided = Passive(ctx), Undecided(ctx, Ranks(None, 1, 2, (0, 1)))
        assert isinstance(passive, WriterMode) and isinstance(undecided, WriterMode)
        assert passive.settle(state) is passive
        # a passive rank publishes nothing: it only counts versions as rank 0 numbers them
        assert (
            passive.publish(state, None) == 0 and passive.publish(state, 7) == 7 and passive.publish(state, None) == 8
        )
        assert passive.version_of(state) is None and passive.state_digest is None and pub.pending == 0
        # an undecided rank of replicated weights becomes rank 1's passive mode
        assert type(undecided.settle(state)) is Passive and undecided.state_digest is None
        for mode in (passive, undecided):
            with pytest.raises(ConfigError, match="cannot continue .* below its newest version"):
                mode.continue_below(state, 0)
    assert [c.version for c in Run(str(tmp_path / "run")).commits()] == [0]


def mode_branches(source: str) -> list[str]:
    """Every decision in class `Publisher` of `source` whose test names the mode (or what picks it)."""
    tree = ast.parse(source)
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "Publisher")
    found = []
    for node in ast.walk(cls):
        tests: list[ast.expr] = []
        if isinstance(node, (ast.If, ast.IfExp, ast.While, ast.Assert)):
            tests = [node.test]
        elif isinstance(node, ast.comprehension):
            tests = list(node.ifs)
        elif isinstance(node, ast.Match):
            tests = [node.subject]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("isinstance", "type"):
            tests = [node]
        for t in tests:
            names = {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}
            names |= {n.attr for n in ast.walk(t) if isinstance(n, ast.Attribute)}
            if names & MODE_NAMES:
                found.append(f"line {t.lineno}: {ast.unparse(t)}")
    return found


def test_publisher_never_branches_on_its_mode():
    source = Path(publisher_module.__file__).read_text()
    assert mode_branches(source) == []
    # nor does it know the modes: it gets its first one from `choice.open_mode`
    imported = {a.name for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ImportFrom) for a in n.names}
    assert not imported & {m.__name__ for m in MODES}


def test_the_branch_check_sees_a_branch_on_the_mode():
    """The check above is not vacuous: the shapes a branch on the mode took are found."""
    source = '''
class Publisher:
    def publish(self, state):
        if isinstance(self._mode, ShardedState):
            pass
        return self._mode.publish(state) if self._mode is not None else 0
'''
    assert len(mode_branches(source)) == 3


def test_a_version_whose_encoding_fails_half_way_is_never_committed(tmp_path):
    """The mode encodes a delta in parts into the queue (`stream.PartStream`): the uploader takes
    its first parts while the last one fails to encode; nothing of that version is committed and
    the publisher stops (the snapshot holds it in some parts only)."""
    url = str(tmp_path / "run")
    state = {n: torch.zeros(1000, dtype=torch.bfloat16) for n in "abc"}  # one part per tensor
    pub = Publisher(url, part_bytes=2048, anchor_every=0)
    pub.publish(state, 0)
    pub.flush()
    bad = {n: t + 1 for n, t in state.items()} | {"c": torch.zeros(999, dtype=torch.bfloat16)}  # the last part
    with pytest.raises(PatchMismatchError, match="tensor 'c': shape") as first:
        pub.publish(bad, 1)
    with pytest.raises(PatchMismatchError) as again:
        pub.flush(timeout=10)  # the uploader stopped waiting for the parts that never came
    assert again.value is first.value
    with pytest.raises(PatchMismatchError):
        pub.publish({n: t + 2 for n, t in state.items()}, 2)
    pub.close()
    assert pub.committed_version == 0 and [c.version for c in Run(url).commits()] == [0]
