"""The model files the tests read, and the skip a test gets where one is absent."""

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
