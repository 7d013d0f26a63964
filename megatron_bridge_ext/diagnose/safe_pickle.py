"""Read a pickle that may only hold plain containers, so that reading a user's file never runs code.

A memory snapshot is ``pickle.dump`` of a dictionary of lists, dictionaries, tuples, strings, integers,
floats, booleans and None (torch/cuda/memory.py, ``_dump_snapshot`` and the ``_snapshot`` docstring,
torch 2.14.1). ``pickle.dump`` of such a value (protocol 2 to 5) uses only the opcodes that build those
types: PROTO, FRAME, EMPTY_DICT, EMPTY_LIST, EMPTY_TUPLE, MARK, SETITEM(S), APPEND(S), TUPLE(1-3),
(SHORT_)BINUNICODE(8), (SHORT_)BINBYTES(8), BININT(1/2), LONG1/4, BINFLOAT, NEWTRUE, NEWFALSE, NONE,
(BIN)PUT/GET, MEMOIZE and STOP. Every opcode that can make anything else needs a callable, and a
callable only enters a pickle through GLOBAL/STACK_GLOBAL or the copyreg extension codes (EXT1/2/4),
all of which the unpickler resolves with ``find_class``, or through a persistent id. :class:`PlainUnpickler`
refuses both, so REDUCE, BUILD, NEWOBJ, INST and OBJ never find anything to call. Sets, frozensets
and bytearrays (no code, but no snapshot holds them) are refused after loading by :func:`load`.
"""

from __future__ import annotations

import pickle
from typing import Any, BinaryIO

PLAIN = (dict, list, tuple, str, bytes, int, float, bool, type(None))
"""The types a snapshot is made of; anything else in the loaded value is refused."""
READ_ERRORS = (pickle.UnpicklingError, EOFError, ValueError, KeyError, IndexError, TypeError, OverflowError,
               MemoryError)
"""What a damaged pickle raises while loading (truncated data, a bad memo index, an unhashable key)."""


class RefusedPickle(pickle.UnpicklingError):
    """A pickle that names a class or function, or that is not made of plain values."""


class PlainUnpickler(pickle.Unpickler):
    """Refuses every global and every persistent id: nothing in the pickle can be called."""

    def find_class(self, module: str, name: str):
        raise RefusedPickle(f"it names {module}.{name}; a memory snapshot holds only plain values "
                            "(dict, list, tuple, str, int, float, bool, None), so nothing in it was run")

    def persistent_load(self, pid):
        raise RefusedPickle("it holds a persistent id; a memory snapshot holds only plain values, "
                            "so nothing in it was run")


def load(fileobj: BinaryIO, name: str) -> Any:
    """The value of the pickle in ``fileobj``, read as a stream; ValueError ``"{name}: ..."`` (one line) when
    it is empty, truncated or damaged, names a class or function, or holds a type other than :data:`PLAIN`."""
    try:
        value = PlainUnpickler(fileobj).load()
    except RefusedPickle as error:
        raise ValueError(f"{name}: refused: {error}") from None
    except EOFError:
        raise ValueError(f"{name}: empty or truncated pickle; expected a whole memory snapshot "
                         "(torch.cuda.memory._dump_snapshot)") from None
    except READ_ERRORS as error:
        detail = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ValueError(f"{name}: not a readable pickle ({detail}); expected a whole memory snapshot "
                         "(torch.cuda.memory._dump_snapshot)") from None
    stray = _first_foreign_type(value)
    if stray is not None:
        raise ValueError(f"{name}: refused: it holds a {stray}; a memory snapshot holds only plain values "
                         "(dict, list, tuple, str, int, float, bool, None)")
    return value


def _first_foreign_type(value: Any):
    """The name of the first type outside :data:`PLAIN` in ``value`` (walked without recursion: a pickle
    may nest deeper than Python's stack, and its memo may make it cyclic), or None."""
    stack, seen = [value], set()
    while stack:
        item = stack.pop()
        if type(item) not in PLAIN:
            return type(item).__name__
        if isinstance(item, (dict, list, tuple)) and id(item) not in seen:
            seen.add(id(item))
            stack.extend(item.keys() if isinstance(item, dict) else ())
            stack.extend(item.values() if isinstance(item, dict) else item)
    return None
