"""Reading the state of Python's ``random`` and numpy's global generator in place.

A rank's own records hold its random streams and are taken twice a step
(:mod:`ftrun.rank.rankstate`). The public getters copy word by word: ``random.getstate()`` builds a
tuple of 625 Python ints (about 25 us), and ``np.random.get_state()`` fills a 624-word array one
element at a time in Cython (about 35 us), together most of a record's cost. Both generators keep
their Mersenne Twister words in one C array; this module reads those bytes (2,500 of them, about
1 us), plus the few scalars next to them:

- numpy: the MT19937 bit generator publishes its state's address
  (``BitGenerator.ctypes.state_address``: ``uint32 key[624]; int pos``). The legacy
  ``RandomState``'s Box-Muller cache (``has_gauss``, ``gauss``: a gaussian drawn in pairs keeps the
  second one, and the next draw takes it without touching the words) lives in the ``RandomState``
  object itself, in numpy's ``aug_bitgen_t { bitgen_t *bit_generator; int has_gauss; double gauss; }``,
  whose ``bit_generator`` points at the object's own copy of the ``bitgen_t``, whose first field
  is that state address. The offsets are found by those two pointers, not assumed.
- Python: CPython's ``RandomObject { PyObject_HEAD; int index; uint32_t state[624]; }``; the offset of
  ``index`` is found by locating a known state's words in a probe object.

Each layout is *calibrated* once per process on a probe generator (the offsets found, then checked
against the public getter for several states, including cached gaussians) and checked once more on
the global generator itself. Any mismatch, or an interpreter other than CPython, and the readers
are not used: callers then use the public getters, as before. Reads happen on the calling thread
with the GIL held, like the getters.
"""

from __future__ import annotations

import ctypes
import random
import struct
import sys
from typing import Any

import numpy as np

MT_WORDS = 624  # Mersenne Twister's state words, in both generators
_PTR = struct.calcsize("P")
_GAUSS_AT = (_PTR + 4 + 7) // 8 * 8  # offset of aug_bitgen_t.gauss (a double after a pointer and an int)


def _unique(memory: bytes, needle: bytes) -> int | None:
    at = memory.find(needle)
    return at if at >= 0 and memory.find(needle, at + 1) < 0 else None


class PythonWords:
    """Reads ``random``'s Mersenne Twister state in place.

    Args:
        inst: the ``random.Random`` whose state is read (default: the one behind the module's
            functions, ``random.getstate.__self__``).

    Attributes:
        ok: whether the layout was found and checked; if not, :meth:`read` must not be called.
    """

    def __init__(self, inst: random.Random | None = None) -> None:
        self.inst = inst if inst is not None else random.getstate.__self__  # type: ignore[attr-defined]
        self.offset = self._calibrate()
        self.ok = self.offset is not None

    def _calibrate(self) -> int | None:
        if sys.implementation.name != "cpython" or not isinstance(self.inst, random.Random):
            return None
        probe = random.Random(20251124)
        state = probe.getstate()[1]
        memory = ctypes.string_at(id(probe), type(probe).__basicsize__)
        offset = _unique(memory, struct.pack(f"=i{MT_WORDS}I", state[MT_WORDS], *state[:MT_WORDS]))
        if offset is None:
            return None
        self.offset = offset
        for draw in (lambda: None, probe.random, lambda: probe.getrandbits(20000), lambda: probe.seed(7)):
            draw()
            if self._words(probe) != tuple(probe.getstate()[1]):
                return None
        return offset if self._words(self.inst) == tuple(self.inst.getstate()[1]) else None

    def _words(self, inst: random.Random) -> tuple[int, ...]:
        raw = ctypes.string_at(id(inst) + self.offset, 4 + 4 * MT_WORDS)
        index, *words = struct.unpack(f"=i{MT_WORDS}I", raw)
        return (*words, index)

    def read(self) -> bytes:
        """The state's bytes: ``int index`` then the 624 ``uint32`` words, native byte order (2,500
        bytes). Equal bytes, equal ``getstate()[1]``; the version and ``gauss_next`` are apart."""
        return ctypes.string_at(id(self.inst) + self.offset, 4 + 4 * MT_WORDS)

    def as_words(self, raw: bytes) -> np.ndarray:
        """:meth:`read`'s bytes in ``RNGState``'s order: ``getstate()[1]`` (624 words, then the
        index), then ``getstate()[0]`` (the version); int64, 626 of them."""
        words = np.empty(MT_WORDS + 2, dtype=np.int64)
        words[:MT_WORDS] = np.frombuffer(raw, dtype=np.uint32, count=MT_WORDS, offset=4)
        words[MT_WORDS] = int.from_bytes(raw[:4], sys.byteorder, signed=True)
        words[MT_WORDS + 1] = self.inst.VERSION
        return words


class NumpyState:
    """Reads numpy's global legacy generator (``np.random.get_state()``) in place.

    Attributes:
        ok: whether the layout was found and checked; if not, :meth:`read` must not be called.
    """

    def __init__(self) -> None:
        self.offset = self._calibrate()
        self.ok = self.offset is not None

    @staticmethod
    def _global() -> Any:
        return np.random.mtrand._rand

    def _calibrate(self) -> int | None:
        if sys.implementation.name != "cpython":
            return None
        try:
            rs = self._global()
            if getattr(np.random.get_state, "__self__", None) is not rs:
                return None
            probe = np.random.RandomState(np.random.MT19937(20251124))
            address = probe._bit_generator.ctypes.state_address
        except Exception:  # another numpy: its public getter then
            return None
        memory = ctypes.string_at(id(probe), type(probe).__basicsize__)
        bitgen = _unique(memory, struct.pack("P", address))  # the object's bitgen_t: its state pointer first
        if bitgen is None:
            return None
        aug = _unique(memory, struct.pack("P", id(probe) + bitgen))  # aug_bitgen_t.bit_generator = &bitgen
        if aug is None or aug + _GAUSS_AT + 8 > len(memory):
            return None
        self.offset = aug
        keys = probe.get_state()[1]
        for has_gauss, gauss in ((1, 0.625), (0, 0.0), (1, -3.25), (0, 1.5)):
            probe.set_state(("MT19937", keys, 7, has_gauss, gauss))
            if not self._equal(probe, self._read(probe)):
                return None
        probe.standard_normal()  # a pair drawn, one kept
        probe.standard_normal()  # the kept one taken: the words stay
        if not self._equal(probe, self._read(probe)):
            return None
        return aug if self._equal(rs, self._read(rs)) else None

    @staticmethod
    def _equal(rs: Any, raw: tuple[bytes, int, float] | None) -> bool:
        if raw is None:
            return False
        state = rs.get_state()
        words, has_gauss, gauss = raw
        return (words == state[1].tobytes() + struct.pack("=i", state[2]) and has_gauss == state[3]
                and struct.pack("=d", gauss) == struct.pack("=d", state[4]))

    def _read(self, rs: Any) -> tuple[bytes, int, float] | None:
        bitgen = rs._bit_generator
        if type(bitgen) is not np.random.MT19937:
            return None
        words = ctypes.string_at(bitgen.ctypes.state_address, 4 * MT_WORDS + 4)
        has_gauss, = struct.unpack("=i", ctypes.string_at(id(rs) + self.offset + _PTR, 4))
        gauss, = struct.unpack("=d", ctypes.string_at(id(rs) + self.offset + _GAUSS_AT, 8))
        return words, has_gauss, gauss

    def read(self) -> tuple[bytes, int, float] | None:
        """``(the 624 key words then pos as native bytes: 2,500; has_gauss; gauss)`` of
        ``np.random.get_state()``; None when the global generator is not MT19937 any more
        (``np.random.set_bit_generator``): use the public getter then."""
        return self._read(self._global())


_readers: tuple[PythonWords | None, NumpyState | None] | None = None


def readers() -> tuple[PythonWords | None, NumpyState | None]:
    """The process's in-place readers (calibrated on first use), each None where its layout was
    not confirmed."""
    global _readers
    if _readers is None:
        py, npy = PythonWords(), NumpyState()
        _readers = (py if py.ok else None, npy if npy.ok else None)
    return _readers
