"Property tests: gradus's shape rules agree with numpy's own, errors included."
import numpy as np
import pytest
from hypothesis import assume, given, settings, strategies as st
from gradus.errors import ShapeError
from gradus.core.shape import (broadcast_shapes, reduce_to_shape, matmul_shape,
                          reshape_shape, normalize_axis)

dims = st.lists(st.integers(1, 4), min_size=0, max_size=4).map(tuple)
dims1 = st.lists(st.integers(1, 4), min_size=1, max_size=4).map(tuple)


def numpy_or_none(fn):
    try: return fn()
    except ValueError: return None


def ours_or_none(fn):
    try: return fn()
    except ShapeError: return None


@settings(max_examples=300, deadline=None)
@given(dims, dims, dims)
def test_broadcast_shapes_matches_numpy(a, b, c):
    expect = numpy_or_none(lambda: np.broadcast_shapes(a, b, c))
    assert ours_or_none(lambda: broadcast_shapes(a, b, c)) == expect


@settings(max_examples=300, deadline=None)
@given(dims1, dims1)
def test_matmul_shape_matches_numpy(a, b):
    expect = numpy_or_none(lambda: np.matmul(np.zeros(a), np.zeros(b)).shape)
    assert ours_or_none(lambda: matmul_shape(a, b)) == expect


@settings(max_examples=300, deadline=None)
@given(dims1, st.lists(st.integers(-1, 6), min_size=1, max_size=4).map(tuple))
def test_reshape_shape_matches_numpy(shape, new):
    expect = numpy_or_none(lambda: np.zeros(shape).reshape(new).shape)
    assert ours_or_none(lambda: reshape_shape(shape, new)) == expect


@settings(max_examples=300, deadline=None)
@given(dims, dims)
def test_reduce_to_shape_inverts_broadcast(shape, extra):
    "Summing a broadcast gradient back gives the operand's shape and the sum of its copies."
    target = numpy_or_none(lambda: np.broadcast_shapes(shape, extra))
    assume(target is not None)
    g = np.random.default_rng(0).standard_normal(target)
    r = reduce_to_shape(g, shape)
    assert r.shape == shape
    ones = np.ones(shape)
    # <g, broadcast(v)> == <reduce(g), v> for v = ones: the defining property of the adjoint
    assert np.isclose(np.sum(g * np.broadcast_to(ones, target)), np.sum(r * ones))


def test_shape_error_names_operation_and_shapes():
    with pytest.raises(ShapeError, match=r"matmul.*\(3, 4\).*\(5, 6\)"):
        matmul_shape((3, 4), (5, 6))
    with pytest.raises(ShapeError, match=r"add.*\(64, 10\).*\(64,\)"):
        broadcast_shapes((64, 10), (64,), op='add')
    with pytest.raises(ShapeError, match=r"matmul.*\(2, 3, 4\) and \(3, 4, 5\).*batch"):
        matmul_shape((2, 3, 4), (3, 4, 5))          # the full shapes, not only the batch parts
    with pytest.raises(ShapeError): reduce_to_shape(np.ones((3, 4)), (5,))


@pytest.mark.parametrize('axis,ndim,expect',
                         [(None, 3, (0, 1, 2)), (-1, 3, (2,)), ((0, -1), 2, (0, 1))])
def test_normalize_axis(axis, ndim, expect):
    assert normalize_axis(axis, ndim) == expect


@pytest.mark.parametrize('axis,ndim', [(3, 3), (-4, 3), ((0, 0), 2)])
def test_normalize_axis_refuses(axis, ndim):
    with pytest.raises(ShapeError): normalize_axis(axis, ndim)
