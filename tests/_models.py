"""The model files the tests read, the skip a test gets where one is absent, and the `gguf`
package's reader of a file, made once per session."""

import functools
from pathlib import Path

import numpy as np
import pytest


def find(path_of, name):
    """`(path or None, skipif mark)` for the model file `path_of()` finds (a `gradus.formats.gguf`
    `*_path`
    function); the mark's reason is the finder's own message, which names the install command."""
    try:
        path, why = path_of(), ''
    except FileNotFoundError as e:
        path, why = None, str(e)
    return path, pytest.mark.skipif(path is None, reason=f"{name} GGUF absent: {why}")


def reader(path):
    """The `gguf` package's `GGUFReader` of the file at `path`, made once per session and shared
    (read only) by every test and reference that reads the file independently of gradus.

    The package's own code parses every field and tensor; only the buffer it slices is a plain
    `ndarray` view of its memory map: numpy's `memmap` subclass costs a few microseconds per slice
    it makes, and the reader makes about four per vocabulary entry (Gemma 3's 262,144 entries:
    13 s of CPU to read the file, 4 s on the plain view; SmolLM2's 49,152: 3 s, 1 s). `path` and
    its resolved form name the same reader."""
    return _reader(str(Path(path).resolve()))


@functools.lru_cache(maxsize=None)
def _reader(path):
    gguf = pytest.importorskip('gguf', reason="the independent reference reads GGUF with `gguf`")

    class _Reader(gguf.GGUFReader):
        @property
        def data(self):
            return self._data

        @data.setter
        def data(self, mapped):  # set once by GGUFReader.__init__, to its np.memmap of the file
            self._data = mapped.view(np.ndarray)

    return _Reader(path)
