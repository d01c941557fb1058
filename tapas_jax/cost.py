"""Cost model and the sharding problem: a graph of decision nodes with strategy costs.

`build_problem` lowers a `Graph` (optionally folded) into a `Problem`, the pairwise cost model
both searches solve:

- a *node* is an input (param or batch; strategies = every spec of its shape) or a leader
  equation (strategies from `tapas_jax.rules`); followers are merged into the node they follow;
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
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections import Counter

import numpy as np

from .collectives import KINDS, bytes_moved, collective_seconds
from .fold import Folding, local_hashes, no_folding
from .graph import Graph
from .hardware import HardwareProfile
from .rules import (
    MeshAxes,
    Spec,
    Strategy,
    batch_dims,
    batch_ok,
    candidate_specs,
    constant_vars,
    follow,
    follow_operand,
    free_strategies,
    has_rule,
    leader_strategies,
    replicated,
    reshard,
)

__all__ = ["Problem", "Lowered", "build_problem"]

KIND_INDEX = {k: i for i, k in enumerate(KINDS)}


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
            if np.allclose(t, a + b, rtol=0, atol=1e-15):
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
    spec_table: dict[int, tuple[list[Spec], np.ndarray]]
    unknown: set[str]
    fixed: dict[int, np.ndarray] = dataclasses.field(default_factory=dict)
    operand_table: dict[tuple[int, int], tuple[list[Spec], np.ndarray]] = dataclasses.field(
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


def _table(specs: list[Spec]) -> tuple[list[Spec], np.ndarray]:
    index: dict[Spec, int] = {}
    idx = np.empty(len(specs), dtype=np.int64)
    for i, s in enumerate(specs):
        idx[i] = index.setdefault(s, len(index))
    return list(index), idx


class _Costs:
    def __init__(self, axes: MeshAxes, hw: HardwareProfile):
        self.axes, self.hw = axes, hw
        self.cache: dict = {}

    def comms(self, comms) -> tuple[float, np.ndarray]:
        t = 0.0
        b = np.zeros(len(KINDS))
        for kind, axis, nbytes in comms:
            p = self.axes.sizes[axis]
            t += collective_seconds(kind, nbytes, p, self.hw)
            b[KIND_INDEX[kind]] += bytes_moved(kind, nbytes, p)
        return t, b

    def strategy(self, s: Strategy) -> tuple[float, float, np.ndarray]:
        t, b = self.comms(s.comms)
        compute = s.flops / self.hw.peak_flops + s.bytes_accessed / self.hw.hbm_bandwidth
        return compute, t, b

    def reshard(self, src: Spec, dst: Spec, shape, itemsize) -> tuple[float, np.ndarray]:
        key = (src, dst, shape, itemsize)
        hit = self.cache.get(key)
        if hit is None:
            hit = self.cache[key] = self.comms(reshard(src, dst, shape, itemsize, self.axes))
        return hit


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
    nbytes = np.array(
        [math.prod(s) * d.itemsize for s, d in zip(graph.shapes, graph.dtypes)], dtype=np.float64
    )
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

    Returns:
      The lowered problem with the tables needed to read a plan back.
    """
    axes = MeshAxes(mesh_axes)
    costs = _Costs(axes, hardware)
    fold = folding if folding is not None else no_folding(graph)
    rep_var, rep_eqn, count = fold.rep_var.tolist(), fold.rep_eqn.tolist(), fold.count.tolist()
    prob = Problem()
    owner: dict[int, int] = {}
    table: dict[int, tuple[list[Spec], np.ndarray]] = {}
    req: dict[tuple[int, int], tuple[list[Spec], np.ndarray]] = {}
    leader: dict[int, int] = {}
    unknown: set[str] = set()
    shapes, dtypes = graph.shapes, graph.dtypes
    const = constant_vars(graph)
    # Equations with equal local hashes have equal rules: evaluate each rule once.
    sig = fold.hashes if fold.hashes is not None else local_hashes(graph)
    rule_cache: dict = {}

    def follow_cached(e, i, k, spec):
        key = (sig[i], k, spec)
        hit = rule_cache.get(key)
        if hit is None:
            hit = rule_cache[key] = follow(e, graph, k, spec, axes)
        return hit

    def leader_cached(e, i):
        key = (sig[i], "leader")
        if key not in rule_cache:
            rule_cache[key] = leader_strategies(e, graph, axes)
        return rule_cache[key]

    if batch_axis is not None and batch_axis in axes.sizes:
        bd = batch_dims(
            graph, [a != param_arg for a in graph.input_args], axes.sizes[batch_axis], fold
        )
    else:
        bd, batch_axis = None, None

    def keep(strategies: list[Strategy], eqn) -> list[Strategy]:
        if bd is None:
            return strategies
        ok = [
            s
            for s in strategies
            if all(batch_ok(sp, bd[o], batch_axis) for sp, o in zip(s.out_specs, eqn.outvars))
            and all(
                sp is None or batch_ok(sp, bd[v], batch_axis)
                for sp, v in zip(s.in_specs, eqn.invars)
                if v is not None
            )
        ]
        return ok or strategies

    def add_costs(node: int, strategies: list[Strategy], idx: np.ndarray, mult: float) -> None:
        c = np.empty(len(strategies))
        t = np.empty(len(strategies))
        b = np.empty((len(strategies), len(KINDS)))
        for i, s in enumerate(strategies):
            c[i], t[i], b[i] = costs.strategy(s)
        prob.compute[node] += mult * c[idx]
        prob.comm[node] += mult * t[idx]
        prob.comm_bytes[node] += mult * b[idx]

    for v, a in zip(graph.inputs, graph.input_args):
        if rep_var[v] != v:
            continue
        specs = candidate_specs(shapes[v], axes)
        if bd is not None and a != param_arg:
            specs = [s for s in specs if batch_ok(s, bd[v], batch_axis)] or specs
        n = prob.add_node(len(specs), graph.input_paths[graph.inputs.index(v)])
        owner[v] = n
        table[v] = _table(specs)

    for i, e in enumerate(graph.eqns):
        if rep_eqn[i] != i:
            continue
        mult = float(count[i])
        k = follow_operand(e, graph, const)
        w = None if k is None else int(rep_var[e.invars[k]])
        if k is not None and w in owner:
            node = owner[w]
            uniq, idx = table[w]
            strategies = [follow_cached(e, i, k, s) for s in uniq]
            add_costs(node, strategies, idx, mult)
        else:
            strategies = leader_cached(e, i)
            if strategies is None and k is not None:
                strategies = free_strategies(e, graph, k, axes)
            if strategies is None:
                if not has_rule(e.prim):
                    unknown.add(e.prim)
                strategies = [replicated(e, graph)]
            strategies = keep(strategies, e)
            node = prob.add_node(len(strategies), f"{e.prim}#{i}")
            idx = np.arange(len(strategies))
            add_costs(node, strategies, idx, mult)
        leader[i] = node
        for o, v in enumerate(e.outvars):
            uniq, sub = _table([s.out_specs[o] for s in strategies])
            owner[v] = node
            table[v] = (uniq, sub[idx])
        for kk, v in enumerate(e.invars):
            if v is not None:
                uniq, sub = _table([s.in_specs[kk] for s in strategies])
                req[(i, kk)] = (uniq, sub[idx])

    # Edges: every operand read of every equation, keyed by representatives.
    eq_idx, var_idx, pos_idx, weight = graph.operand_arrays()
    keys = np.stack([fold.rep_var[var_idx], fold.rep_eqn[eq_idx], pos_idx], axis=1)
    uniq_keys, inverse = np.unique(keys, axis=0, return_inverse=True)
    counts = np.bincount(inverse.ravel(), weights=weight, minlength=len(uniq_keys))
    reads = {tuple(k): float(c) for k, c in zip(uniq_keys.tolist(), counts.tolist())}
    for (w, r, kk), c in reads.items():
        src_uniq, src_idx = table[w]
        dst_uniq, dst_idx = req[(r, kk)]
        shape, item = shapes[w], dtypes[w].itemsize
        t_small = np.zeros((len(src_uniq), len(dst_uniq)))
        b_small = np.zeros((len(src_uniq), len(dst_uniq), len(KINDS)))
        for a, s in enumerate(src_uniq):
            for bb, d in enumerate(dst_uniq):
                if s != d:
                    t_small[a, bb], b_small[a, bb] = costs.reshard(s, d, shape, item)
        if not t_small.any():
            continue
        u, n = owner[w], leader[r]
        if u == n:
            prob.comm[u] += c * t_small[src_idx, dst_idx]
            prob.comm_bytes[u] += c * b_small[src_idx, dst_idx]
        else:
            prob.add_edge(
                u, n, c * t_small[np.ix_(src_idx, dst_idx)], c * b_small[np.ix_(src_idx, dst_idx)]
            )

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
