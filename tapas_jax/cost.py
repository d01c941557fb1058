"""Cost model and the sharding problem: a graph of decision nodes with strategy costs.

`build_problem` lowers a `Graph` (optionally folded) into a `Problem`, the pairwise cost model
both searches solve:

- a *node* is an input (param or batch; strategies = every spec of its shape) or a leader
  equation (strategies from `tapas_jax.leader_rules`); followers (`tapas_jax.follower_rules`)
  are merged into the node they follow;
- a node's unary cost per strategy: compute (FLOPs / peak, bytes / HBM bandwidth) plus the
  collectives inside its equations (partial-sum all-reduces), under the alpha-beta model of
  `tapas_jax.collectives`;
- an *edge* between two nodes: the resharding collectives (all-gather, all-to-all; slicing is
  free) needed when a variable laid out by one node's strategy is read by an equation that wants
  another layout;
- a linear memory model: per-device bytes of the params (plus optimizer state) and of the
  variables live at the peak of a reference schedule, each divided by its shards.

With a `Folding`, only representative equations are lowered and every cost is multiplied by its
multiplicity, so the folded problem is the original with every copy of a block tied together.
Step seconds = compute + communication (no overlap assumed).

The module stays one file (~510 lines): `build_problem` is one pass whose stages share the
interned spec tables, owners and caches it builds; split, they would pass all of them around.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections import Counter
from typing import NamedTuple

import numpy as np

from .batch_inference import batch_dims, batch_ok
from .collectives import KINDS, bytes_moved, collective_seconds
from .fold import Folding, local_hashes, no_folding
from .follower_rules import constant_vars, follow_operand, follower, free_strategies
from .graph import Graph
from .hardware import HardwareProfile
from .leader_rules import has_rule, leader_strategies
from .spec_algebra import MeshAxes, Spec, Strategy, candidate_specs, replicated, reshard

__all__ = ["Problem", "Lowered", "build_problem"]

KIND_INDEX = {k: i for i, k in enumerate(KINDS)}
_MISSING = object()


@dataclasses.dataclass
class Problem:
    """Nodes with per-strategy costs and pairwise edge costs (seconds), plus memory per strategy."""

    sizes: list[int] = dataclasses.field(default_factory=list)
    compute: list[np.ndarray] = dataclasses.field(default_factory=list)
    comm: list[np.ndarray] = dataclasses.field(default_factory=list)
    comm_bytes: list[np.ndarray] = dataclasses.field(default_factory=list)
    """Per node, ``[S, len(KINDS)]`` bytes moved per device by collective kind."""
    memory: list[np.ndarray] = dataclasses.field(default_factory=list)
    edges: dict[tuple[int, int], np.ndarray] = dataclasses.field(default_factory=dict)
    edge_bytes: dict[tuple[int, int], np.ndarray] = dataclasses.field(default_factory=dict)
    memory_base: float = 0.0
    labels: list[str] = dataclasses.field(default_factory=list)
    """What each node is (an input path or a primitive), for reports."""

    def add_node(self, size: int, label: str = "") -> int:
        self.labels.append(label)
        self.sizes.append(size)
        self.compute.append(np.zeros(size))
        self.comm.append(np.zeros(size))
        self.comm_bytes.append(np.zeros((size, len(KINDS))))
        self.memory.append(np.zeros(size))
        return len(self.sizes) - 1

    def unary(self, n: int) -> np.ndarray:
        return self.compute[n] + self.comm[n]

    def add_edge(self, u: int, v: int, t: np.ndarray, b: np.ndarray) -> None:
        if u > v:
            u, v, t, b = v, u, t.T, b.transpose(1, 0, 2)
        key = (u, v)
        if key in self.edges:
            self.edges[key] = self.edges[key] + t
            self.edge_bytes[key] = self.edge_bytes[key] + b
        else:
            self.edges[key] = t
            self.edge_bytes[key] = b

    def simplify(self) -> None:
        """Moves edge costs that split into per-node parts (``a[i] + b[j]``) into unary costs."""
        for key in list(self.edges):
            t = self.edges[key]
            u, v = key
            a = t[:, :1]
            b = t[:1, :] - t[0, 0]
            if np.all(np.abs(t - (a + b)) <= 1e-15):  # allclose(rtol=0, atol=1e-15), finite
                bb = self.edge_bytes.pop(key)
                del self.edges[key]
                self.comm[u] += a[:, 0]
                self.comm[v] += b[0]
                self.comm_bytes[u] += bb[:, 0, :]
                self.comm_bytes[v] += bb[0, :, :] - bb[0, 0, :]

    def objective(self, choice: np.ndarray) -> float:
        """Step seconds of a choice of strategy per node."""
        total = sum(float(self.unary(n)[choice[n]]) for n in range(len(self.sizes)))
        for (u, v), t in self.edges.items():
            total += float(t[choice[u], choice[v]])
        return total

    def breakdown(self, choice: np.ndarray) -> dict[str, object]:
        """Compute seconds, comm seconds, bytes by kind and memory of a choice."""
        compute = sum(float(self.compute[n][choice[n]]) for n in range(len(self.sizes)))
        comm = sum(float(self.comm[n][choice[n]]) for n in range(len(self.sizes)))
        by_kind = sum(self.comm_bytes[n][choice[n]] for n in range(len(self.sizes)))
        for (u, v), t in self.edges.items():
            comm += float(t[choice[u], choice[v]])
            by_kind = by_kind + self.edge_bytes[(u, v)][choice[u], choice[v]]
        memory = self.memory_base + sum(
            float(self.memory[n][choice[n]]) for n in range(len(self.sizes))
        )
        return {
            "compute_seconds": compute,
            "comm_seconds": comm,
            "comm_bytes_by_kind": {k: float(by_kind[i]) for i, k in enumerate(KINDS)},
            "peak_memory_bytes": memory,
        }

    def min_memory(self) -> float:
        return self.memory_base + sum(float(m.min()) for m in self.memory)


@dataclasses.dataclass
class Lowered:
    """A problem plus how to read a plan back: owners and spec tables of variables."""

    problem: Problem
    graph: Graph
    folding: Folding
    axes: MeshAxes
    owner: dict[int, int]
    spec_table: dict[int, tuple[tuple[Spec, ...], np.ndarray]]
    unknown: set[str]
    fixed: dict[int, np.ndarray] = dataclasses.field(default_factory=dict)
    operand_table: dict[tuple[int, int], tuple[tuple[Spec, ...], np.ndarray]] = dataclasses.field(
        default_factory=dict
    )
    """(representative equation, operand position) -> the layouts its strategies read the
    operand in, indexed like `spec_table` through `leader`."""
    leader: dict[int, int] = dataclasses.field(default_factory=dict)
    """Representative equation -> the node that decides its strategy."""

    def operand_spec(self, i: int, k: int, choice: np.ndarray) -> Spec:
        """The layout equation `i` reads its operand `k` in under `choice`."""
        r = int(self.folding.rep_eqn[i])
        uniq, idx = self.operand_table[(r, k)]
        return uniq[idx[choice[self.leader[r]]]]

    def spec_of(self, v: int, choice: np.ndarray) -> Spec:
        r = int(self.folding.rep_var[v])
        uniq, idx = self.spec_table[r]
        return uniq[idx[choice[self.owner[r]]]]


def _table(specs: list[Spec], interned: dict) -> tuple[tuple[Spec, ...], np.ndarray]:
    """The distinct specs in order of first appearance, and the index of each spec in them.

    Equal tuples of distinct specs are one object (``interned``), so later stages may key
    tables by identity.
    """
    index: dict[Spec, int] = {}
    idx = [index.setdefault(s, len(index)) for s in specs]
    uniq = tuple(index)
    return interned.setdefault(uniq, uniq), np.array(idx, dtype=np.int64)


class _Rule(NamedTuple):
    """An equation's strategies, priced, with the spec tables of its results and operands."""

    size: int
    price: np.ndarray
    """Per strategy: compute seconds, comm seconds, then bytes moved by collective kind."""
    outs: list[tuple[tuple[Spec, ...], np.ndarray]]
    ins: list[tuple[tuple[Spec, ...], np.ndarray] | None]


class _Costs:
    def __init__(self, axes: MeshAxes, hw: HardwareProfile):
        self.axes, self.hw = axes, hw
        self.cache: dict = {}
        self.rows: dict = {}
        self.no_bytes = np.zeros(len(KINDS))

    def comms(self, comms) -> tuple[float, np.ndarray]:
        t = 0.0
        b = np.zeros(len(KINDS))
        for kind, axis, nbytes in comms:
            p = self.axes.sizes[axis]
            t += collective_seconds(kind, nbytes, p, self.hw)
            b[KIND_INDEX[kind]] += bytes_moved(kind, nbytes, p)
        return t, b

    def row(self, s: Strategy) -> tuple[float, ...]:
        """Compute seconds, comm seconds, then bytes moved by kind, of one strategy (cached by
        its cost fields: many strategies cost the same)."""
        key = s[2:]
        hit = self.rows.get(key)
        if hit is None:
            t, b = self.comms(s.comms) if s.comms else (0.0, self.no_bytes)
            compute = s.flops / self.hw.peak_flops + s.bytes_accessed / self.hw.hbm_bandwidth
            hit = self.rows[key] = (compute, t, *b.tolist())
        return hit

    def reshard(self, src: Spec, dst: Spec, shape, itemsize) -> tuple[float, np.ndarray]:
        key = (src, dst, shape, itemsize)
        hit = self.cache.get(key)
        if hit is None:
            hit = self.cache[key] = self.comms(reshard(src, dst, shape, itemsize, self.axes))
        return hit


def _reshard_table(
    costs: _Costs, src: tuple[Spec, ...], dst: tuple[Spec, ...], shape, itemsize: int
) -> tuple[np.ndarray, np.ndarray] | None:
    """Seconds and bytes by kind to turn each layout of `src` into each of `dst`; None if free."""
    zero = (0.0, np.zeros(len(KINDS)))
    pairs = [costs.reshard(s, d, shape, itemsize) if s != d else zero for s in src for d in dst]
    t = np.array([p[0] for p in pairs]).reshape(len(src), len(dst))
    if not t.any():
        return None
    return t, np.array([p[1] for p in pairs]).reshape(len(src), len(dst), len(KINDS))


def _loop_pairs(graph: Graph, param_arg: int) -> list[tuple[int, int]]:
    """(output, param) variable pairs of a step whose outputs include its updated params.

    The first output subtree with the structure of the params argument (``new_params`` of
    ``step(params, batch) -> (new_params, loss)``) is read leaf by leaf as the next call's params.
    """
    if graph.in_treedef is None or graph.out_treedef is None:
        return []
    args = graph.in_treedef.children()
    if param_arg >= len(args):
        return []
    params = [v for v, a in zip(graph.inputs, graph.input_args) if a == param_arg]
    offset = 0
    for child in graph.out_treedef.children():
        if child == args[param_arg]:
            outs = graph.outputs[offset : offset + child.num_leaves]
            return [
                (o, v)
                for o, v in zip(outs, params)
                if o is not None and o != v and graph.shapes[o] == graph.shapes[v]
            ]
        offset += child.num_leaves
    return []


def _peak_live(graph: Graph, constant: list[bool]) -> np.ndarray:
    """Intermediate variables live at the peak of the program order (replicated sizes).

    Constants (broadcast literals, iotas) are left out: XLA fuses them into their readers.
    """
    eq, var, _, _ = graph.operand_arrays()
    n_eqns = len(graph.eqns)
    producer = graph.producer_array()
    last = np.full(graph.num_vars, -1, dtype=np.int64)
    np.maximum.at(last, var, eq)
    outs = np.array([v for v in graph.outputs if v is not None], dtype=np.int64)
    if outs.size:
        last[outs] = n_eqns
    nbytes = graph.var_nbytes()
    inter = (producer >= 0) & (last >= 0) & ~np.asarray(constant, dtype=bool)
    alloc = np.bincount(producer[inter], weights=nbytes[inter], minlength=n_eqns + 1)
    # a variable is freed after its last reader runs
    free = np.bincount(np.minimum(last[inter], n_eqns), weights=nbytes[inter], minlength=n_eqns + 1)
    live_after_alloc = np.cumsum(alloc) - np.concatenate([[0.0], np.cumsum(free)[:-1]])
    t = int(np.argmax(live_after_alloc[:n_eqns])) if n_eqns else 0
    return np.flatnonzero(inter & (producer <= t) & (last >= t))


def build_problem(
    graph: Graph,
    mesh_axes: dict[str, int],
    hardware: HardwareProfile,
    folding: Folding | None = None,
    optimizer_state_factor: float = 0.0,
    param_arg: int = 0,
    batch_axis: str | None = "data",
    fsdp: bool = False,
) -> Lowered:
    """Lowers `graph` into a `Problem` over `mesh_axes` priced on `hardware`.

    Args:
      graph: the flattened graph.
      mesh_axes: mesh axis name -> size.
      hardware: the chip.
      folding: representatives and multiplicities; None solves the unfolded graph.
      optimizer_state_factor: optimizer state bytes per param byte (2 for Adam, 0 for SGD).
      param_arg: which positional argument holds the params.
      batch_axis: the mesh axis that splits the batch: on every variable with a batch dimension
        it sits on that dimension, and on no other activation (params may still be split over
        it, FSDP-style). None, or an axis the mesh lacks, leaves every axis free.
      fsdp: the ZeRO-3 / FSDP space: a summed result may be reduce-scattered (over the batch
        axis, or over any axis without one) instead of all-reduced, and values without a batch
        dimension (params, gradients, updates) may stay split over the batch axis.

    Returns:
      The lowered problem with the tables needed to read a plan back.
    """
    axes = MeshAxes(mesh_axes)
    costs = _Costs(axes, hardware)
    fold = folding if folding is not None else no_folding(graph)
    rep_var, count = fold.rep_var.tolist(), fold.count.tolist()
    prob = Problem()
    owner: dict[int, int] = {}
    table: dict[int, tuple[tuple[Spec, ...], np.ndarray]] = {}
    req: dict[tuple[int, int], tuple[tuple[Spec, ...], np.ndarray]] = {}
    leader: dict[int, int] = {}
    unknown: set[str] = set()
    interned: dict = {}  # spec tables, see `_table`
    shapes, dtypes = graph.shapes, graph.dtypes
    const = constant_vars(graph)
    # Equations with equal local hashes have equal rules: evaluate each rule once.
    sig = fold.hashes if fold.hashes is not None else local_hashes(graph)
    sig = sig.tolist()

    if batch_axis is not None and batch_axis in axes.sizes:
        bd = batch_dims(
            graph, [a != param_arg for a in graph.input_args], axes.sizes[batch_axis], fold
        )
    else:
        bd, batch_axis = None, None

    def unbatched_ok(spec: Spec, dim: int | None) -> bool:
        return batch_ok(spec, dim, batch_axis) or (fsdp and dim is None)

    def keep(strategies: list[Strategy], eqn) -> list[Strategy]:
        if bd is None:
            return strategies
        ok = [
            s
            for s in strategies
            # reduce-scatter only over the batch axis (ZeRO): the other axes keep all-reduces
            if all(c[1] == batch_axis for c in s.comms if c[0] == "reduce-scatter")
            and all(unbatched_ok(sp, bd[o]) for sp, o in zip(s.out_specs, eqn.outvars))
            and all(
                sp is None or unbatched_ok(sp, bd[v])
                for sp, v in zip(s.in_specs, eqn.invars)
                if v is not None
            )
        ]
        return ok or strategies

    def priced(strategies: list[Strategy], eqn) -> _Rule:
        price = np.array([costs.row(s) for s in strategies])
        outs = [
            _table([s.out_specs[o] for s in strategies], interned) for o in range(len(eqn.outvars))
        ]
        ins = [
            None if v is None else _table([s.in_specs[kk] for s in strategies], interned)
            for kk, v in enumerate(eqn.invars)
        ]
        return _Rule(len(strategies), price, outs, ins)

    leader_cache: dict = {}

    def leader_rule(e, i: int, k: int | None) -> _Rule:
        if sig[i] not in leader_cache:
            leader_cache[sig[i]] = leader_strategies(e, graph, axes, reduce_scatter=fsdp)
        strategies = leader_cache[sig[i]]
        if strategies is None and k is not None:
            strategies = free_strategies(e, graph, k, axes)
        if strategies is None:
            strategies = [replicated(e, graph)]
        return priced(keep(strategies, e), e)

    price: list[np.ndarray] = []  # per node, the sum of its equations' `_Rule.price` rows
    for v, a, path in zip(graph.inputs, graph.input_args, graph.input_paths):
        if rep_var[v] != v:
            continue
        specs = candidate_specs(shapes[v], axes)
        if bd is not None and a != param_arg:
            specs = [s for s in specs if batch_ok(s, bd[v], batch_axis)] or specs
        n = prob.add_node(len(specs), path)
        price.append(np.zeros((len(specs), 2 + len(KINDS))))
        owner[v] = n
        table[v] = _table(specs, interned)

    # Equations with equal local hashes have equal rules, so a rule's priced strategies and the
    # spec tables they induce are computed once per local hash and what else the rule reads:
    # the followed operand's table (followers) or the batch dimensions (leaders).
    rules: dict[tuple, _Rule] = {}
    for i in np.flatnonzero(fold.rep_eqn == np.arange(len(graph.eqns))).tolist():
        e = graph.eqns[i]
        mult = float(count[i])
        k = follow_operand(e, graph, const)
        w = None if k is None else int(rep_var[e.invars[k]])
        if k is not None and w in owner:
            node = owner[w]
            uniq, idx = table[w]
            key = ("follow", sig[i], k, id(uniq))  # tables are interned
            rule = rules.get(key)
            if rule is None:
                rule = rules[key] = priced(list(map(follower(e, graph, k, axes), uniq)), e)
            price[node] += mult * rule.price[idx]
        else:
            batch = (
                None
                if bd is None
                else tuple(bd[v] for v in (*e.outvars, *e.invars) if v is not None)
            )
            key = ("lead", sig[i], k, batch)
            rule = rules.get(key)
            if rule is None:
                rule = rules[key] = leader_rule(e, i, k)
            if not has_rule(e.prim):
                unknown.add(e.prim)
            node = prob.add_node(rule.size, f"{e.prim}#{i}")
            price.append(mult * rule.price)
            idx = None
        leader[i] = node
        for v, (uniq, sub) in zip(e.outvars, rule.outs):
            owner[v] = node
            table[v] = (uniq, sub if idx is None else sub[idx])
        for kk, t in enumerate(rule.ins):
            if t is not None:
                req[(i, kk)] = (t[0], t[1] if idx is None else t[1][idx])

    for node, p in enumerate(price):
        prob.compute[node] += p[:, 0]
        prob.comm[node] += p[:, 1]
        prob.comm_bytes[node] += p[:, 2:]

    # Edges: every operand read of every equation, keyed by representatives.
    eq_idx, var_idx, pos_idx, weight = graph.operand_arrays()
    n_eqns, n_pos = len(graph.eqns), int(pos_idx.max(initial=0)) + 1
    keys = (fold.rep_var[var_idx] * n_eqns + fold.rep_eqn[eq_idx]) * n_pos + pos_idx
    uniq_keys, inverse = np.unique(keys, return_inverse=True)
    counts = np.bincount(inverse.ravel(), weights=weight, minlength=len(uniq_keys))
    # Reshard tables by (source table, destination table, aval): tables are interned, so
    # identity keys are exact and cheap (hashing the spec tuples per read is not).
    resharding: dict[tuple, tuple[np.ndarray, np.ndarray] | None] = {}
    aval = graph.aval_ids()[0].tolist()
    read_var, rest = np.divmod(uniq_keys, n_eqns * n_pos)
    read_eqn, read_pos = np.divmod(rest, n_pos)

    def charge(w: int, n: int, c: float, dst_uniq, dst_idx) -> None:
        """Prices reading variable `w` `c` times in the layouts `dst_uniq`[`dst_idx`] of node n."""
        src_uniq, src_idx = table[w]
        rkey = (id(src_uniq), id(dst_uniq), aval[w])
        small = resharding.get(rkey, _MISSING)
        if small is _MISSING:
            small = resharding[rkey] = _reshard_table(
                costs, src_uniq, dst_uniq, shapes[w], dtypes[w].itemsize
            )
        if small is None:  # no layout pair costs anything
            return
        t_small, b_small = small
        u = owner[w]
        if u == n:
            t_read = t_small[src_idx, dst_idx]
            if t_read.any():  # a node mostly reads its own results in the layout it wrote
                prob.comm[u] += c * t_read
                prob.comm_bytes[u] += c * b_small[src_idx, dst_idx]
        else:
            rows, cols = src_idx[:, None], dst_idx[None, :]
            prob.add_edge(u, n, c * t_small[rows, cols], c * b_small[rows, cols])

    for w, r, kk, c in zip(
        read_var.tolist(), read_eqn.tolist(), read_pos.tolist(), counts.tolist()
    ):
        charge(w, leader[r], c, *req[(r, kk)])

    # A training step's next call reads its params in the layout this call wrote them: that
    # reshard is part of the step (without it, writing updated params in another layout than
    # they are read, e.g. left split over the data axis after a reduce-scatter, looks free).
    loop: Counter = Counter()
    for v_out, v_in in _loop_pairs(graph, param_arg):
        loop[(rep_var[v_out], rep_var[v_in])] += 1
    for (w, p), c in loop.items():
        if w != p and w in owner:
            charge(w, owner[p], c, *table[p])

    # Memory: params (+ optimizer state) and the activations live at the peak.
    mem_vars: Counter = Counter()
    for v, a in zip(graph.inputs, graph.input_args):
        mem_vars[rep_var[v]] += (1.0 + optimizer_state_factor) if a == param_arg else 1.0
    peak = fold.rep_var[_peak_live(graph, const)]
    for w, c in zip(*np.unique(peak, return_counts=True)):
        mem_vars[int(w)] += float(c)
    for w, c in mem_vars.items():
        if w not in owner:
            continue
        uniq, idx = table[w]
        full = math.prod(shapes[w]) * dtypes[w].itemsize
        per = np.array([full / axes.shards(s) for s in uniq])
        prob.memory[owner[w]] += c * per[idx]
    prob.simplify()
    if unknown:
        warnings.warn(
            "tapas_jax: no sharding rule for primitive(s) "
            + ", ".join(sorted(unknown))
            + "; their operands and results are planned replicated",
            stacklevel=2,
        )
    return Lowered(prob, graph, fold, axes, owner, table, unknown, operand_table=req, leader=leader)
