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


# ------------------------------------------------------------------------------------------------
# Hostile pickles: every opcode route to a callable, each written opcode by opcode (pickletools' names)
# ------------------------------------------------------------------------------------------------


class _TouchOnNew:
    """A class whose construction runs ``touch MARKER``: the NEWOBJ/NEWOBJ_EX route calls ``cls.__new__``, which
    no builtin that runs a command has, so the live payload names this test module's class."""

    def __new__(cls, command):
        os.system(command)
        return object.__new__(cls)


def _unicode(text: str) -> bytes:
    """SHORT_BINUNICODE (protocol 4) of ``text``."""
    data = text.encode()
    return b"\x8c" + bytes([len(data)]) + data


def _global(module: str, name: str) -> bytes:
    """GLOBAL (protocol 0): ``c`` module newline name newline."""
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def _stack_global(module: str, name: str) -> bytes:
    """STACK_GLOBAL (protocol 4): the two names as strings on the stack, then ``\\x93``."""
    return _unicode(module) + _unicode(name) + b"\x93"


def _call(callable_: bytes, *args: bytes) -> bytes:
    """REDUCE: the callable, MARK, the arguments, TUPLE, ``R``."""
    return callable_ + b"(" + b"".join(args) + b"tR"


def _shell(marker) -> str:
    return f"touch {marker}"


def _python(marker) -> str:
    return f"__import__('os').system({_shell(marker)!r})"


def _hostile(route: str, marker) -> bytes:
    """The pickle of ``route`` whose loading by plain pickle runs ``touch marker``."""
    proto = b"\x80\x04"
    shell, python = _unicode(_shell(marker)), _unicode(_python(marker))
    module = __name__
    payloads = {
        "GLOBAL builtins.eval": lambda: proto + _call(_global("builtins", "eval"), python),
        "STACK_GLOBAL builtins.eval": lambda: proto + _call(_stack_global("builtins", "eval"), python),
        "GLOBAL builtins.exec": lambda: proto + _call(_global("builtins", "exec"), python),
        "STACK_GLOBAL builtins.exec": lambda: proto + _call(_stack_global("builtins", "exec"), python),
        # getattr(import_module("os"), "system")("touch ..."): two calls chained, no os global named at all
        "builtins.getattr on importlib.import_module": lambda: proto + _call(
            _call(_stack_global("builtins", "getattr"), _call(_stack_global("importlib", "import_module"),
                                                              _unicode("os")), _unicode("system")), shell),
        "STACK_GLOBAL os.system": lambda: proto + _call(_stack_global("os", "system"), shell),
        "GLOBAL posix.system": lambda: proto + _call(_global(os.system.__module__, "system"), shell),
        # Popen(["touch", marker]).wait() is not needed: the child runs whether or not anyone waits
        "STACK_GLOBAL subprocess.Popen": lambda: proto + _call(
            _stack_global("subprocess", "Popen"), b"]" + b"(" + _unicode("touch") + _unicode(str(marker)) + b"e"),
        # pickle.loads(an inner pickle that calls os.system): the outer load names only pickle.loads
        "nested pickle.loads": lambda: proto + _call(
            _stack_global("pickle", "loads"), _binbytes(proto + _call(_stack_global("os", "system"), shell) + b".")),
        # INST: MARK, the arguments, then ``i`` module newline name newline: calls name(*args)
        "INST builtins.eval": lambda: b"(" + python + b"i" + b"builtins\neval\n",
        # OBJ: MARK, the callable, the arguments, ``o``: calls callable(*args)
        "OBJ builtins.exec": lambda: proto + b"(" + _stack_global("builtins", "exec") + python + b"o",
        # NEWOBJ / NEWOBJ_EX: cls, the argument tuple (and kwargs), then cls.__new__(cls, *args)
        "NEWOBJ": lambda: proto + _stack_global(module, "_TouchOnNew") + b"(" + shell + b"t\x81",
        "NEWOBJ_EX": lambda: proto + _stack_global(module, "_TouchOnNew") + b"(" + shell + b"t}\x92",
        # EXT2: a copyreg extension code that the registry maps to os.system (registered by the test)
        "EXT2 os.system": lambda: proto + b"\x83" + EXT_CODE.to_bytes(2, "little") + b"(" + shell + b"tR",
    }
    return payloads[route]() + b"."


def _binbytes(data: bytes) -> bytes:
    """BINBYTES: ``B``, a 4-byte little-endian length, the bytes."""
    return b"B" + len(data).to_bytes(4, "little") + data


EXT_CODE = 0x7E57
HOSTILE = ["GLOBAL builtins.eval", "STACK_GLOBAL builtins.eval", "GLOBAL builtins.exec", "STACK_GLOBAL builtins.exec",
           "builtins.getattr on importlib.import_module", "STACK_GLOBAL os.system", "GLOBAL posix.system",
           "STACK_GLOBAL subprocess.Popen", "nested pickle.loads", "INST builtins.eval", "OBJ builtins.exec",
           "NEWOBJ", "NEWOBJ_EX", "EXT2 os.system"]


@pytest.fixture
def os_system_extension():
    """copyreg's extension registry maps EXT_CODE to os.system for the test's duration (the EXT routes)."""
    import copyreg

    copyreg.add_extension(os.system.__module__, "system", EXT_CODE)
    yield
    copyreg.remove_extension(os.system.__module__, "system", EXT_CODE)


_CHILD_SECONDS = 2.0
"""How long a spawned child (the Popen route) gets to run its command; the other routes run it before load returns."""


def _wait_for(marker, seconds: float = _CHILD_SECONDS) -> bool:
    """Whether ``marker`` appears within ``seconds`` (Popen's child runs beside the test)."""
    import time

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if marker.exists():
            return True
        time.sleep(0.05)
    return marker.exists()


@pytest.mark.parametrize("route", HOSTILE)
def test_each_hostile_pickle_runs_its_command_under_plain_pickle(route, tmp_path, os_system_extension):
    """The control of the table: each payload is live, so the marker's absence below means something."""
    marker = tmp_path / "ran"
    try:
        pickle.loads(_hostile(route, marker))
    except Exception:  # the command has run before any later opcode fails (e.g. OBJ on an int result)
        pass
    assert _wait_for(marker), route


@pytest.mark.parametrize("route", HOSTILE)
def test_each_hostile_pickle_is_refused_naming_the_file_and_its_command_does_not_run(route, tmp_path,
                                                                                   os_system_extension):
    marker = tmp_path / "ran"
    with pytest.raises(ValueError) as error:
        load(io.BytesIO(_hostile(route, marker)), "hostile.pickle")
    text = _one_line_naming(error, "hostile.pickle")
    assert "refused" in text and "nothing in it was run" in text, text
    assert not _wait_for(marker, _CHILD_SECONDS if "Popen" in route else 0), f"{route}: the command ran"
