"""The plain-value unpickler: a snapshot's pickle comes back whole; anything that could run code is refused
before it runs, and a damaged file is answered in one line naming it."""

from __future__ import annotations

import collections
import io
import os
import pickle

import pytest

from megatron_bridge_ext.diagnose.safe_pickle import load
from tests.support import snapshots as S

pytestmark = pytest.mark.unit


class _Shell:
    """Unpickling this runs ``touch MARKER`` through os.system (``__reduce__``)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _one_line_naming(error: pytest.ExceptionInfo, name: str) -> str:
    text = str(error.value)
    assert text.startswith(f"{name}: ") and "\n" not in text, text
    return text


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_a_snapshot_comes_back_equal_at_every_protocol(protocol):
    data = S.snapshot([S.segment([S.block(S.MiB), S.block(2 * S.MiB, "inactive")])], {0: [S.oom(4 * S.MiB, 0)]},
                      S.allocator_settings(True))
    assert load(io.BytesIO(pickle.dumps(data, protocol=protocol)), "s.pickle") == data


def test_a_pickle_whose_reduce_runs_a_shell_command_is_refused_and_the_command_does_not_run(tmp_path):
    marker = tmp_path / "ran"
    payload = pickle.dumps({"segments": [], "x": _Shell(marker)})
    with pytest.raises(ValueError) as error:
        load(io.BytesIO(payload), "evil.pickle")
    text = _one_line_naming(error, "evil.pickle")
    assert f"{os.system.__module__}.system" in text and "nothing in it was run" in text
    assert not marker.exists()


def test_the_same_kind_of_pickle_does_run_its_command_under_plain_pickle(tmp_path):
    """The control for the test above: the payload is live, so its marker's absence there means something."""
    marker = tmp_path / "ran"
    pickle.loads(pickle.dumps(_Shell(marker)))
    assert marker.exists()


@pytest.mark.parametrize("payload, expected", [
    (pickle.dumps(collections.OrderedDict(a=1)), "collections.OrderedDict"),
    (pickle.dumps({1, 2}), "set"),
    (pickle.dumps(frozenset({1})), "frozenset"),
    (pickle.dumps(bytearray(b"x"), protocol=5), "bytearray"),
    (pickle.dumps(b"raw", protocol=2), "_codecs.encode"),  # protocol 2 writes bytes through a global
], ids=["OrderedDict", "set", "frozenset", "bytearray", "bytes-at-protocol-2"])
def test_a_harmless_class_or_a_non_plain_type_is_refused(payload, expected):
    with pytest.raises(ValueError) as error:
        load(io.BytesIO(payload), "odd.pickle")
    assert expected in _one_line_naming(error, "odd.pickle")


def test_a_persistent_id_is_refused():
    buffer = io.BytesIO()

    class Persistent(pickle.Pickler):
        def persistent_id(self, obj):
            return "tensor-0" if obj == "external" else None

    Persistent(buffer, protocol=4).dump({"segments": ["external"]})
    with pytest.raises(ValueError) as error:
        load(io.BytesIO(buffer.getvalue()), "pid.pickle")
    assert "persistent id" in _one_line_naming(error, "pid.pickle")


@pytest.mark.parametrize("payload, expected", [
    (b"", "empty or truncated"),
    (pickle.dumps(S.snapshot([S.segment([S.block(S.MiB)])]))[:-7], "truncated"),
    (b"\x80\x04K\x01K\x02s.", "not a readable pickle"),  # SETITEM on an int
], ids=["empty", "truncated", "damaged"])
def test_an_empty_truncated_or_damaged_stream_is_one_line_naming_the_file(payload, expected):
    with pytest.raises(ValueError) as error:
        load(io.BytesIO(payload), "bad.pickle")
    assert expected in _one_line_naming(error, "bad.pickle")


def test_nesting_deeper_than_the_interpreter_stack_and_cycles_are_read():
    depth = 50_000
    nested = b"\x80\x02" + b"]" * depth + b"a" * (depth - 1) + b"."  # EMPTY_LIST x depth, APPEND x depth-1
    value = load(io.BytesIO(nested), "deep.pickle")
    for _ in range(depth - 1):
        (value,) = value
    assert value == []
    cyclic = []
    cyclic.append(cyclic)
    loaded = load(io.BytesIO(pickle.dumps(cyclic)), "cycle.pickle")
    assert loaded[0] is loaded
