"""Folding's bulk keys: equal rows get equal ids, literals and interned heads key as the
per-equation keys do, constants respect program order."""

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np

from tapas_jax import zoo
from tapas_jax.fold import _literal_ids, _literal_key, _longest_run, _row_ids, local_hashes
from tapas_jax.follower_rules import constant_vars
from tapas_jax.graph import Eqn, Graph, build_graph


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


def test_literal_ids_partition_literals_as_their_keys_do():
    lits = jax.make_jaxpr(lambda x: x * 2.0 + 1 - 0.0)(jnp.ones(3)).eqns
    lits = [v.val for e in lits for v in e.invars if hasattr(v, "val")]  # JAX's own literals
    lits += [2.0, np.float32(2.0), np.float64(-0.0), 0.0, float("nan"), float("nan")]
    lits += [np.array([3.0], np.float32), np.float32(3.0), np.arange(3), np.arange(3), True, 1]
    ids = _literal_ids(lits)
    index: dict = {}
    keys = [index.setdefault(_literal_key(x), len(index)) for x in lits]
    for (a, ka), (b, kb) in itertools.combinations(zip(ids.tolist(), keys), 2):
        assert (a == b) == (ka == kb)
    assert ids.min() == 0 and len(set(ids.tolist())) == len(index)  # dense


def test_heads_interned_while_flattening_equal_heads_interned_later():
    model = zoo.build("gpt", layers=3)
    graph = build_graph(model.fn, model.params, *model.inputs)
    assert graph.heads is not None and len(graph.heads) == len(graph.eqns)
    by_hand = dataclasses.replace(graph, heads=None)  # no interned heads, no cached arrays
    np.testing.assert_array_equal(local_hashes(graph), local_hashes(by_hand))
    np.testing.assert_array_equal(graph.aval_ids()[0], by_hand.aval_ids()[0])
    assert graph.aval_ids()[1] == by_hand.aval_ids()[1]
