"""Folding's bulk keys: equal rows get equal ids, constants respect program order."""

import itertools

import numpy as np

from tapas_jax.fold import _longest_run, _row_ids
from tapas_jax.follower_rules import constant_vars
from tapas_jax.graph import Eqn, Graph


def test_row_ids_number_equal_rows_alike_in_order_of_first_appearance():
    rng = np.random.default_rng(0)
    for width, span in [(1, 3), (7, 50), (12, 10**6)]:  # the last re-numbers to avoid overflow
        rows = rng.integers(-span, span, size=(400, width))
        rows[200:] = rows[rng.integers(0, 200, size=200)]
        seen: dict[tuple, int] = {}
        expected = [seen.setdefault(tuple(r), len(seen) + 1) for r in rows.tolist()]
        np.testing.assert_array_equal(_row_ids(rows), expected)


def test_constant_vars_do_not_follow_a_scan_carry_back_edge():
    f32 = np.dtype("float32")
    eqns = [
        Eqn("constant", {"value": 0.0}, [], [], [1]),
        Eqn("scan_carry", {"length": 3}, [1, 3], [None, None], [2]),  # reads v3 before it exists
        Eqn("iota", {}, [], [], [3]),
        Eqn("add", {}, [0, 2], [None, None], [4]),
    ]
    graph = Graph(eqns, [()] * 5, [f32] * 5, [0], [4], ["x"], [0])
    assert constant_vars(graph) == [False, True, False, True, False]


def test_longest_run_is_the_first_longest_run_of_true():
    def brute(mask):
        best = (0, 0)
        for start, group in itertools.groupby(enumerate(mask.tolist()), key=lambda x: x[1]):
            items = list(group)
            if start and len(items) > best[1]:
                best = (items[0][0], len(items))
        return best

    rng = np.random.default_rng(0)
    for n in range(0, 30):
        for _ in range(50):
            mask = rng.random(n) < rng.random()
            assert _longest_run(mask) == brute(mask)
