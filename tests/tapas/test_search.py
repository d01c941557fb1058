"""The folded DP search against the integer program on the same cost model."""

import json

import numpy as np
import pytest

from tapas_jax import bench, zoo
from tapas_jax.cost import Problem, build_problem
from tapas_jax.fold import fold_repeated_blocks, no_folding
from tapas_jax.graph import build_graph
from tapas_jax.hardware import get_profile
from tapas_jax.ilp import solve_ilp
from tapas_jax.search import eliminate, solve

MESH = {"data": 2, "model": 4}


def _random_problem(seed: int, n: int = 7, s: int = 3) -> Problem:
    rng = np.random.default_rng(seed)
    prob = Problem()
    for _ in range(n):
        i = prob.add_node(s)
        prob.compute[i] += rng.random(s)
        prob.memory[i] += rng.random(s)
    for u in range(n):
        for v in range(u + 1, n):
            if rng.random() < 0.5:
                prob.add_edge(u, v, rng.random((s, s)), np.zeros((s, s, 4)))
    return prob


@pytest.mark.parametrize("seed", range(4))
def test_elimination_and_ilp_agree_with_brute_force(seed):
    prob = _random_problem(seed)
    grid = np.stack(np.meshgrid(*[range(s) for s in prob.sizes], indexing="ij"), -1)
    best = min(prob.objective(c) for c in grid.reshape(-1, len(prob.sizes)))
    assert prob.objective(eliminate(prob)) == pytest.approx(best, rel=1e-12)
    assert solve_ilp(prob, time_limit=30).objective == pytest.approx(best, rel=1e-9)


def test_memory_budget_is_respected_by_both():
    prob = _random_problem(11)
    budget = 0.5 * (prob.min_memory() + sum(m.max() for m in prob.memory))
    grid = np.stack(np.meshgrid(*[range(s) for s in prob.sizes], indexing="ij"), -1)
    feasible = [
        c
        for c in grid.reshape(-1, len(prob.sizes))
        if sum(prob.memory[i][x] for i, x in enumerate(c)) <= budget
    ]
    best = min(prob.objective(c) for c in feasible)
    ilp = solve_ilp(prob, memory_limit=budget)
    assert ilp.objective == pytest.approx(best, rel=1e-9)
    dp = solve(prob, memory_limit=budget)  # Lagrangian: feasible, maybe not optimal
    assert sum(prob.memory[i][x] for i, x in enumerate(dp.choice)) <= budget
    assert dp.objective >= best - 1e-12


def test_folded_search_matches_ilp_optimum_on_gpt():
    m = zoo.build("gpt", layers=3, d_model=128, heads=4, seq_len=64, batch=8, vocab=256)
    graph = build_graph(m.fn, m.params, *m.inputs)
    hw = get_profile("tpu-v5e")
    folded = build_problem(graph, MESH, hw, fold_repeated_blocks(graph))
    unfolded = build_problem(graph, MESH, hw, no_folding(graph))
    assert len(folded.problem.sizes) < len(unfolded.problem.sizes)
    tapas = solve(folded.problem, hw.hbm_bytes)
    ilp = solve_ilp(unfolded.problem, hw.hbm_bytes, time_limit=60)
    assert ilp.optimal
    assert tapas.objective <= ilp.objective * 1.01
    assert tapas.objective >= ilp.objective * (1 - 1e-9)


def test_bench_command_writes_rows_and_plot(tmp_path):
    out = tmp_path / "bench.json"
    flags = ["--d-model", "64", "--heads", "4", "--seq-len", "16", "--batch", "4", "--vocab", "128"]
    assert bench.main(["bench", "--layers", "2", "--no-warmup", *flags, "--json", str(out)]) == 0
    row = json.loads(out.read_text())["rows"][0]
    keys = {"layers", "tapas_seconds", "ilp_seconds", "tapas_cost", "ilp_cost", "megatron_cost"}
    assert keys <= set(row)
    assert row["tapas_cost"] <= row["megatron_cost"] * (1 + 1e-9)
    assert row["tapas_cost"] == pytest.approx(row["ilp_cost"], rel=0.01)
    assert out.with_suffix(".png").stat().st_size > 1000


def test_bench_config_from_flags_and_overrides():
    args = bench.build_parser().parse_args(["--layers", "2,4", "--space", "full", "--no-warmup"])
    cfg = bench.config_from_args(args)
    assert (cfg.layers, cfg.space, cfg.warmup, cfg.d_model) == ([2, 4], "full", False, 256)
    args = bench.build_parser().parse_args(["--layers", "2,4", "layers=[3]", "d_model=64"])
    assert bench.config_from_args(args).layers == [3]
    for bad in (["--layers", "2,x"], ["space=everything"], ["layers=[]"]):
        with pytest.raises(ValueError):
            bench.config_from_args(bench.build_parser().parse_args(bad))
