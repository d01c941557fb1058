"""`plan(fn, params, *inputs, mesh=...)`: from a JAX function to a `Plan` of PartitionSpecs.

Pipeline: trace (`tapas_jax.graph`) -> fold repeated layers (`tapas_jax.fold`) -> lower to the
cost model (`tapas_jax.cost`) -> exact search on the folded problem (`tapas_jax.search`) ->
read the chosen strategies back as a `PartitionSpec` per input and output leaf.

A `Plan` is plain data: specs per pytree path, the prediction (bytes communicated per step by
collective kind, compute and communication seconds, peak memory per device), folding statistics
and the search time. It round-trips through JSON; `Plan.jit(fn)` applies it with `jax.jit`.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from .constraints import SpecList, constrained
from .cost import Lowered, build_problem
from .fold import Folding, fold_repeated_blocks, no_folding
from .graph import Graph, build_graph
from .hardware import HardwareProfile, get_profile
from .search import MemoryInfeasibleError, solve

__all__ = ["Plan", "plan", "lower", "plan_from_lowered", "cost_with_param_specs"]


def _pspec(spec) -> PartitionSpec:
    return PartitionSpec(*spec)


@dataclasses.dataclass
class Plan:
    """A sharding plan: specs for every input and output leaf, with its predicted cost."""

    param_paths: dict[str, SpecList]
    """Params leaf path -> mesh axis (or None) per dimension."""
    input_paths: list[dict[str, SpecList]]
    """For each positional argument after the params: leaf path -> spec."""
    output_specs: list[SpecList]
    """Specs of the flattened outputs."""
    mesh_axes: dict[str, int]
    hardware: str
    predicted: dict[str, Any]
    fold: dict[str, int]
    search_seconds: float
    method: str = "dp"
    constraints: dict[str, SpecList] = dataclasses.field(default_factory=dict, repr=False)
    """Layouts the plan chose for intermediate results (every non-scalar result outside scan
    bodies), keyed by their position in the traced program; `jit` pins them with sharding
    constraints so the partitioner follows the plan. Keys ``"<position>@<k>"`` pin operand ``k``
    of that equation where the plan reads it in another layout than it was made in (so a
    contraction priced as gathering its operands is not turned into a partial-sum all-reduce)."""
    mesh: Any = dataclasses.field(default=None, repr=False, compare=False)
    in_treedef: Any = dataclasses.field(default=None, repr=False, compare=False)
    out_treedef: Any = dataclasses.field(default=None, repr=False, compare=False)

    # ------------------------------------------------------------------ pytrees
    def _arg_specs(self) -> list[list[PartitionSpec]]:
        args = [[_pspec(s) for s in self.param_paths.values()]]
        args += [[_pspec(s) for s in d.values()] for d in self.input_paths]
        return args

    @property
    def param_specs(self) -> Any:
        """A pytree of `PartitionSpec` with the structure of the params argument."""
        if self.in_treedef is None:
            return _nested({k: _pspec(v) for k, v in self.param_paths.items()})
        return self._in_spec_tree()[0]

    def _in_spec_tree(self) -> tuple:
        leaves = [p for arg in self._arg_specs() for p in arg]
        return jax.tree_util.tree_unflatten(self.in_treedef, leaves)

    def _need_mesh(self, mesh):
        mesh = mesh if mesh is not None else self.mesh
        if mesh is None or isinstance(mesh, jax.sharding.AbstractMesh):
            raise ValueError("this plan has no concrete mesh; pass mesh=make_mesh(...)")
        if dict(mesh.shape) != self.mesh_axes:
            raise ValueError(f"mesh {dict(mesh.shape)} differs from the plan's {self.mesh_axes}")
        return mesh

    @property
    def in_shardings(self) -> tuple:
        """`NamedSharding` pytrees for every positional argument (params first), on `mesh`."""
        return self.in_shardings_on(None)

    @property
    def out_shardings(self) -> Any:
        """`NamedSharding` pytree for the outputs, on `mesh`."""
        return self.out_shardings_on(None)

    def in_shardings_on(self, mesh=None) -> tuple:
        """`in_shardings` on another mesh of the same shape (e.g. after `from_json`)."""
        mesh = self._need_mesh(mesh)
        if self.in_treedef is None:
            raise ValueError("a plan read from JSON needs with_structure(params, *inputs) first")
        return jax.tree.map(
            lambda s: NamedSharding(mesh, s),
            self._in_spec_tree(),
            is_leaf=lambda x: isinstance(x, PartitionSpec),
        )

    def out_shardings_on(self, mesh=None) -> Any:
        """`out_shardings` on another mesh of the same shape."""
        mesh = self._need_mesh(mesh)
        if self.out_treedef is None:
            raise ValueError("a plan read from JSON needs with_structure(params, *inputs) first")
        leaves = [NamedSharding(mesh, _pspec(s)) for s in self.output_specs]
        return jax.tree_util.tree_unflatten(self.out_treedef, leaves)

    def param_shardings(self, mesh=None) -> dict[str, NamedSharding]:
        """Params leaf path -> `NamedSharding` on `mesh` (works on a plan read from JSON)."""
        mesh = self._need_mesh(mesh)
        return {k: NamedSharding(mesh, _pspec(v)) for k, v in self.param_paths.items()}

    def jit(
        self, fn: Callable[..., Any], mesh=None, constrain: bool = True, **jit_kwargs
    ) -> Callable[..., Any]:
        """``jax.jit(fn)`` with this plan's input and output shardings.

        With ``constrain`` (the default) the intermediate layouts the plan chose are pinned with
        `jax.lax.with_sharding_constraint`, so the partitioner follows the plan rather than
        re-deriving its own (the function is re-traced and evaluated equation by equation).
        """
        target = fn
        if constrain and self.constraints:
            target = constrained(fn, self.constraints, self._need_mesh(mesh))
        return jax.jit(
            target,
            in_shardings=self.in_shardings_on(mesh),
            out_shardings=self.out_shardings_on(mesh),
            **jit_kwargs,
        )

    def with_structure(self, fn: Callable[..., Any], params: Any, *inputs: Any, mesh=None) -> Plan:
        """Attaches the pytree structure of ``fn(params, *inputs)`` (after `from_json`)."""
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), (params, *inputs)
        )
        out = jax.eval_shape(fn, *abstract)
        return dataclasses.replace(
            self,
            mesh=mesh if mesh is not None else self.mesh,
            in_treedef=jax.tree_util.tree_structure(abstract),
            out_treedef=jax.tree_util.tree_structure(out),
        )

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, Any]:
        return {
            "param_specs": self.param_paths,
            "input_specs": self.input_paths,
            "output_specs": self.output_specs,
            "mesh": self.mesh_axes,
            "hardware": self.hardware,
            "predicted": self.predicted,
            "fold": self.fold,
            "search_seconds": self.search_seconds,
            "method": self.method,
            "constraints": self.constraints,
        }

    def to_json(self, indent: int | None = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        d = json.loads(text)
        missing = {
            "param_specs",
            "input_specs",
            "output_specs",
            "mesh",
            "hardware",
            "predicted",
            "fold",
            "search_seconds",
        } - set(d)
        if missing:
            raise ValueError(f"plan JSON lacks key(s) {', '.join(sorted(missing))}")
        return cls(
            d["param_specs"],
            d["input_specs"],
            d["output_specs"],
            d["mesh"],
            d["hardware"],
            d["predicted"],
            d["fold"],
            d["search_seconds"],
            d.get("method", "dp"),
            d.get("constraints", {}),
        )

    # ------------------------------------------------------------------ table
    def __str__(self) -> str:
        rows: dict[tuple[str, str], int] = {}
        for path, spec in self.param_paths.items():
            key = (re.sub(r"/\d+/", "/*/", path), _fmt(spec))
            rows[key] = rows.get(key, 0) + 1
        width = max([len(p) for p, _ in rows] + [10])
        lines = [f"{'param':<{width}}  {'copies':>6}  spec", "-" * (width + 30)]
        for (path, spec), n in rows.items():
            lines.append(f"{path:<{width}}  {n:>6}  {spec}")
        for i, d in enumerate(self.input_paths):
            for path, spec in d.items():
                lines.append(
                    f"{'input ' + str(i + 1) + ' ' + path:<{width}}  {'':>6}  {_fmt(spec)}"
                )
        p = self.predicted
        kinds = (
            ", ".join(f"{k} {v / 1e6:.3f} MB" for k, v in p["comm_bytes_by_kind"].items() if v > 0)
            or "none"
        )
        lines += [
            "",
            f"mesh {self.mesh_axes} on {self.hardware}; search {self.search_seconds:.3f} s "
            f"({self.method})",
            f"fold: {self.fold['layers']} layers, {self.fold['unique_blocks']} unique blocks, "
            f"{self.fold['eqns_before']} -> {self.fold['eqns_after']} equations",
            f"predicted step {p['step_seconds'] * 1e3:.4f} ms = compute "
            f"{p['compute_seconds'] * 1e3:.4f} ms + comm {p['comm_seconds'] * 1e3:.4f} ms; "
            f"comm/device {p['comm_bytes'] / 1e6:.3f} MB ({kinds}); "
            f"peak memory {p['peak_memory_bytes'] / 2**20:.1f} MiB",
        ]
        return "\n".join(lines)


def _fmt(spec: SpecList) -> str:
    return "(" + ", ".join("-" if a is None else a for a in spec) + ")"


def _nested(flat: Mapping[str, Any]) -> dict:
    out: dict = {}
    for path, v in flat.items():
        parts = path.split("/")
        d = out
        for p in parts[:-1]:
            d = d.setdefault(p, {})
        d[parts[-1]] = v
    return out


def _folding(graph: Graph, fold: bool) -> Folding:
    """The folding `lower` and `plan` use: repeated blocks folded, or none when not `fold`."""
    return fold_repeated_blocks(graph) if fold else no_folding(graph)


def lower(
    fn,
    params,
    *inputs,
    mesh,
    hardware="tpu-v5e",
    fold=True,
    optimizer_state_factor=0.0,
    batch_axis: str | None = "data",
    fsdp: bool = False,
    graph: Graph | None = None,
    folding: Folding | None = None,
) -> tuple[Lowered, float]:
    """Traces (unless ``graph`` is given), folds (unless ``folding`` of it is given) and lowers;
    returns the lowered problem and the seconds spent folding and lowering."""
    graph = build_graph(fn, params, *inputs) if graph is None else graph
    t0 = time.perf_counter()
    if folding is None:
        folding = _folding(graph, fold)
    hw = get_profile(hardware)
    axes = {k: int(v) for k, v in dict(mesh.shape).items()}
    lowered = build_problem(
        graph, axes, hw, folding, optimizer_state_factor, batch_axis=batch_axis, fsdp=fsdp
    )
    return lowered, time.perf_counter() - t0


def plan_from_lowered(
    lowered: Lowered, choice: np.ndarray, *, mesh, hardware: str, search_seconds: float, method: str
) -> Plan:
    """Reads a choice of strategies back into a `Plan`."""
    g: Graph = lowered.graph
    nargs = max(g.input_args) + 1 if g.input_args else 1
    per_arg: list[dict[str, SpecList]] = [{} for _ in range(nargs)]
    for v, path, a in zip(g.inputs, g.input_paths, g.input_args):
        per_arg[a][path] = list(lowered.spec_of(v, choice))
    outputs = [list(lowered.spec_of(v, choice)) if v is not None else [] for v in g.outputs]
    constraints: dict[str, SpecList] = {}
    for e in g.eqns:
        if e.src is not None and len(e.outvars) == 1 and g.shapes[e.outvars[0]]:
            constraints["/".join(map(str, e.src))] = list(lowered.spec_of(e.outvars[0], choice))
    # Operands the plan reads in another layout than they were made in (a contraction that
    # gathers its operands rather than all-reducing partial sums): pinned too, as
    # ``"<path>@<operand>"``, or XLA may pick another way to the same result layout.
    for i, e in enumerate(g.eqns):
        if e.src is None:
            continue
        for k, v in enumerate(e.invars):
            if v is None or not g.shapes[v]:
                continue
            want = lowered.operand_spec(i, k, choice)
            if want != lowered.spec_of(v, choice):
                constraints["/".join(map(str, e.src)) + f"@{k}"] = list(want)
    b = lowered.problem.breakdown(choice)
    by_kind = b["comm_bytes_by_kind"]
    predicted = {
        "comm_bytes": float(sum(by_kind.values())),
        "comm_bytes_by_kind": by_kind,
        "compute_seconds": b["compute_seconds"],
        "comm_seconds": b["comm_seconds"],
        "step_seconds": b["compute_seconds"] + b["comm_seconds"],
        "peak_memory_bytes": b["peak_memory_bytes"],
    }
    f = lowered.folding
    fold = {
        "layers": f.layers,
        "unique_blocks": f.unique_blocks,
        "eqns_before": g.count_eqns(),
        "eqns_after": f.eqns_after,
    }
    return Plan(
        per_arg[0],
        per_arg[1:],
        outputs,
        {k: int(v) for k, v in dict(mesh.shape).items()},
        get_profile(hardware).name,
        predicted,
        fold,
        search_seconds,
        method,
        constraints,
        mesh,
        g.in_treedef,
        g.out_treedef,
    )


def plan(
    fn: Callable[..., Any],
    params: Any,
    *inputs: Any,
    mesh,
    hardware: str | HardwareProfile = "tpu-v5e",
    memory_limit_bytes: float | None = None,
    optimizer_state_factor: float = 0.0,
    fold: bool = True,
    time_limit: float = 60.0,
    batch_axis: str | None = "data",
    fsdp: bool | None = None,
) -> Plan:
    """Plans the sharding of ``fn(params, *inputs)`` on `mesh`.

    From Flax NNX, split the model and close over the static parts::

        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        def forward(params, x):
            return nnx.merge(graphdef, params, rest)(x)
        p = tapas_jax.plan(forward, params, x, mesh=make_mesh("data=2,model=4"))
        tapas_jax.shard(model, p)  # split, device_put by the plan, update (tapas_jax.placement)
        y = p.jit(forward)(nnx.state(model, nnx.Param), x)

    (``params`` may be abstract: ``nnx.split(nnx.eval_shape(lambda: Model(...)), nnx.Param, ...)``.)

    Args:
      fn: a pure JAX function whose first argument is the params pytree (a training step or a
        forward pass).
      params: params pytree of arrays or `jax.ShapeDtypeStruct`.
      *inputs: the other arguments (arrays or `jax.ShapeDtypeStruct` pytrees).
      mesh: a `jax.sharding.Mesh` or `AbstractMesh` (from `tapas_jax.mesh`).
      hardware: hardware profile name or object pricing compute and collectives.
      memory_limit_bytes: per-device memory budget; None uses the profile's HBM size.
      optimizer_state_factor: optimizer-state bytes per param byte kept by a training step
        (2 for Adam; 0 for plain SGD or a forward pass).
      fold: fold repeated layers (the fast search); False solves the unfolded graph.
      time_limit: time limit of the integer-program fallback, seconds.
      batch_axis: the mesh axis that splits dimension 0 of every input after the params (and
        whatever carries it); None leaves every mesh axis free for every dimension.
      fsdp: search the FSDP / ZeRO-3 space too (gradients reduce-scattered over the batch axis,
        params, gradients and updates kept split over it; `tapas_jax.cost.build_problem`).
        None (the default) adds it only where the plan without it is bound by the memory limit
        (or does not fit), and keeps whichever plan is cheaper; True always; False never.

    Returns:
      The `Plan`.

    Raises:
      MemoryInfeasibleError: no plan fits; the message states the smallest memory that would.
    """
    hw = get_profile(hardware)
    limit = hw.hbm_bytes if memory_limit_bytes is None else float(memory_limit_bytes)
    graph = build_graph(fn, params, *inputs)
    t0 = time.perf_counter()
    # Folded once: the FSDP retry below lowers the same graph again.
    folding = _folding(graph, fold)
    fold_seconds = time.perf_counter() - t0
    common = dict(
        mesh=mesh,
        hardware=hw,
        optimizer_state_factor=optimizer_state_factor,
        batch_axis=batch_axis,
        graph=graph,
        folding=folding,
    )
    lowered, search_seconds = lower(fn, params, *inputs, fsdp=bool(fsdp), **common)
    search_seconds += fold_seconds
    t0 = time.perf_counter()
    try:
        result = solve(lowered.problem, limit, time_limit)
    except MemoryInfeasibleError:
        if fsdp is not None:
            raise
        result = None
    search_seconds += time.perf_counter() - t0
    if fsdp is None and (result is None or result.memory_price > 0):
        # Memory-bound without FSDP: search the larger space too and keep the cheaper plan.
        zero, seconds = lower(fn, params, *inputs, fsdp=True, **common)
        zero_result = solve(zero.problem, limit, time_limit)
        search_seconds += seconds + zero_result.seconds
        if result is None or zero_result.objective < result.objective:
            lowered, result = zero, zero_result
    return plan_from_lowered(
        lowered,
        result.choice,
        mesh=mesh,
        hardware=hw.name,
        search_seconds=search_seconds,
        method=result.method,
    )


def cost_with_param_specs(lowered: Lowered, specs: Callable[[str, int], Any]) -> float:
    """Step seconds of the best plan whose params follow ``specs(path, ndim)``.

    ``specs`` returns a spec per dimension (mesh axes of size 1 or absent read as None) or None
    for "no opinion": that param stays free and the search picks its best layout. A spec the
    search space cannot express raises ValueError rather than being silently left free.
    """
    prob = lowered.problem
    g = lowered.graph
    compute = [c.copy() for c in prob.compute]
    # An excluded strategy costs more than any whole plan (kept finite for the ILP fallback).
    penalty = 10.0 * (
        1.0
        + sum(float(prob.unary(n).max()) for n in range(len(prob.sizes)))
        + sum(float(t.max()) for t in prob.edges.values())
    )
    for v, path, a in zip(g.inputs, g.input_paths, g.input_args):
        if a != 0 or int(lowered.folding.rep_var[v]) != v:
            continue
        want = specs(path, len(g.shapes[v]))
        if want is None:
            continue
        want = tuple(x if lowered.axes.sizes.get(x, 1) > 1 else None for x in want)
        uniq, idx = lowered.spec_table[v]
        if want not in uniq:
            raise ValueError(
                f"param {path!r}: spec {want} is outside the search space "
                f"(it allows {', '.join(map(str, uniq))})"
            )
        n = lowered.owner[v]
        compute[n] = np.where(idx == uniq.index(want), compute[n], penalty)
    fixed = dataclasses.replace(prob, compute=compute)
    return solve(fixed).objective
