"""tapas_jax.plan on the zoo GPT: folding, the Megatron pattern, JSON, memory and divisibility."""

import json
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tapas_jax import zoo
from tapas_jax.fold import fold_repeated_blocks
from tapas_jax.graph import build_graph
from tapas_jax.planner import Plan, cost_with_param_specs, lower, plan
from tapas_jax.search import MemoryInfeasibleError

MEGATRON_OUT = ("query", "key", "value", "fc1")
MEGATRON_IN = ("out", "fc2")


@pytest.fixture(scope="module")
def gpt_small():
    return zoo.build("gpt", layers=3, d_model=256, heads=8, seq_len=128, batch=8, vocab=512)


@pytest.fixture(scope="module")
def gpt_plan(gpt_small, mesh_2x4):
    m = gpt_small
    return plan(m.fn, m.params, *m.inputs, mesh=mesh_2x4, hardware="tpu-v5e")


def test_fold_finds_layers_of_unrolled_gpt(gpt_small):
    m = gpt_small
    graph = build_graph(m.fn, m.params, *m.inputs)
    folding = fold_repeated_blocks(graph)
    assert folding.layers == 3
    # forward layers, backward layers and the per-layer SGD update
    assert folding.unique_blocks == 3
    assert folding.eqns_after < 0.6 * folding.eqns_before
    # copies of a block map to one representative, copied equation by equation
    for b in folding.blocks:
        reps = folding.rep_eqn[b.start : b.start + b.period * b.copies].reshape(b.copies, -1)
        assert (reps == reps[1]).all()
        assert folding.count[reps[1][0]] == b.copies


def test_plan_recovers_megatron_pattern(gpt_plan):
    specs = gpt_plan.param_paths
    for layer in range(3):
        for name in MEGATRON_OUT:
            sub = "attn" if name != "fc1" else "mlp"
            assert specs[f"blocks/{layer}/{sub}/{name}/kernel"] == [None, "model"], name
        for name in MEGATRON_IN:
            sub = "attn" if name == "out" else "mlp"
            assert specs[f"blocks/{layer}/{sub}/{name}/kernel"] == ["model", None], name
    # batch over the data axis
    assert gpt_plan.input_paths[0]["arg1"] == ["data", None]
    assert gpt_plan.fold["layers"] == 3


def test_plan_is_no_worse_than_megatron_and_replication(gpt_small, mesh_2x4, gpt_plan):
    m = gpt_small
    lowered, _ = lower(m.fn, m.params, *m.inputs, mesh=mesh_2x4, hardware="tpu-v5e")
    mine = gpt_plan.predicted["step_seconds"]
    assert mine <= cost_with_param_specs(lowered, zoo.megatron_rules) * (1 + 1e-9)
    assert mine < cost_with_param_specs(lowered, lambda p, n: (None,) * n)


def test_megatron_rules_split_vocabulary_and_leave_the_rest_free():
    rules = zoo.megatron_rules
    assert rules("embed/embedding", 2) == ("model", None)
    assert rules("head/kernel", 2) == (None, "model")
    assert rules("blocks/0/attn/query/kernel", 2) == (None, "model")
    assert rules("blocks/0/attn/query/bias", 1) == ("model",)
    assert rules("blocks/0/mlp/fc2/kernel", 2) == ("model", None)
    assert rules("blocks/0/mlp/fc2/bias", 1) == (None,)
    # stacked (scanned) layers keep their layer dimension whole
    assert rules("blocks/attn/out/kernel", 3) == (None, "model", None)
    for free in ("blocks/0/ln1/scale", "ln_f/bias", "pos"):
        assert rules(free, 1) is None


def test_no_opinion_leaves_params_free(gpt_small, mesh_2x4, gpt_plan):
    m = gpt_small
    lowered, _ = lower(m.fn, m.params, *m.inputs, mesh=mesh_2x4, hardware="tpu-v5e")
    free = cost_with_param_specs(lowered, lambda p, n: None)
    assert free == pytest.approx(gpt_plan.predicted["step_seconds"], rel=1e-9)
    # pinning the norms replicated is an opinion, and may only cost more
    pinned = cost_with_param_specs(lowered, lambda p, n: zoo.megatron_rules(p, n) or (None,) * n)
    assert cost_with_param_specs(lowered, zoo.megatron_rules) <= pinned * (1 + 1e-12)
    with pytest.raises(ValueError, match="outside the search space"):
        cost_with_param_specs(lowered, lambda p, n: ("data",) * n if p == "pos" else None)


def test_param_specs_pytree_matches_params(gpt_small, gpt_plan):
    specs = gpt_plan.param_specs
    is_spec = lambda x: isinstance(x, jax.sharding.PartitionSpec)  # noqa: E731
    assert jax.tree.structure(specs, is_leaf=is_spec) == jax.tree.structure(gpt_small.params)
    leaves = jax.tree.leaves(specs, is_leaf=is_spec)
    assert all(is_spec(s) for s in leaves)


def test_json_round_trip(gpt_plan):
    text = gpt_plan.to_json()
    again = Plan.from_json(text)
    assert again == gpt_plan
    assert again.to_json() == text
    d = json.loads(text)
    assert {"param_specs", "fold", "search_seconds", "predicted"} <= set(d)
    assert {"comm_bytes", "step_seconds", "peak_memory_bytes"} <= set(d["predicted"])
    assert re.search(r"blocks/\*/mlp/fc1/kernel +3 +\(-, model\)", str(gpt_plan))
    with pytest.raises(ValueError, match="lacks key"):
        Plan.from_json('{"param_specs": {}}')


def test_memory_infeasible_states_smallest_fit(gpt_small, mesh_2x4):
    m = gpt_small
    with pytest.raises(MemoryInfeasibleError, match=r"smallest memory that would fit is"):
        plan(m.fn, m.params, *m.inputs, mesh=mesh_2x4, memory_limit_bytes=1e5)


def test_tight_memory_shards_more(gpt_small, mesh_2x4, gpt_plan):
    m = gpt_small
    roomy = gpt_plan.predicted["peak_memory_bytes"]
    # Within one search space a tighter limit never makes the step cheaper. (The default adds the
    # FSDP space only under memory pressure, so compare each space with itself.)
    for fsdp in (False, True):
        roomy_plan = plan(m.fn, m.params, *m.inputs, mesh=mesh_2x4, fsdp=fsdp)
        tight = plan(
            m.fn, m.params, *m.inputs, mesh=mesh_2x4, memory_limit_bytes=0.9 * roomy, fsdp=fsdp
        )
        assert tight.predicted["peak_memory_bytes"] <= 0.9 * roomy
        assert tight.predicted["step_seconds"] >= roomy_plan.predicted["step_seconds"]
    # the larger (FSDP) space, the last searched, is never costlier than the default's plan
    assert roomy_plan.predicted["step_seconds"] <= gpt_plan.predicted["step_seconds"]


def test_axes_that_do_not_divide_are_never_chosen(mesh_2x4):
    m = zoo.build("gpt", layers=2, d_model=48, heads=6, seq_len=10, batch=6, vocab=250)
    p = plan(m.fn, m.params, *m.inputs, mesh=mesh_2x4, hardware="tpu-v5e")
    sizes = dict(mesh_2x4.shape)
    shapes = {path: leaf.shape for path, leaf in zip(p.param_paths, jax.tree.leaves(m.params))}
    for path, spec in p.param_paths.items():
        for dim, axis in zip(shapes[path], spec):
            assert axis is None or dim % sizes[axis] == 0, (path, spec)
    assert p.input_paths[0]["arg1"][0] is None or 6 % sizes["data"] == 0


def test_unknown_primitive_is_replicated_with_warning(mesh_2x4):
    w = jax.ShapeDtypeStruct((64, 64), jnp.float32)
    x = jax.ShapeDtypeStruct((8, 64), jnp.float32)

    def fn(params, x):
        h = x @ params["w"]
        vals, _ = jax.lax.top_k(h, 4)
        return vals.sum()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        p = plan(fn, {"w": w}, x, mesh=mesh_2x4)
    assert any("top_k" in str(c.message) for c in caught)
    assert np.isfinite(p.predicted["step_seconds"])


def test_generic_nnx_forward_plans_and_runs(mesh_2x4):
    from flax import nnx

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.fc1 = nnx.Linear(64, 256, rngs=rngs)
            self.fc2 = nnx.Linear(256, 64, rngs=rngs)

        def __call__(self, x):
            return self.fc2(jax.nn.relu(self.fc1(x)))

    model = MLP(nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def forward(params, x):
        return nnx.merge(graphdef, params, rest)(x)

    x = jax.random.normal(jax.random.key(1), (16, 64))
    p = plan(forward, params, x, mesh=mesh_2x4, hardware="tpu-v5e")
    sharded_params = jax.device_put(params, p.in_shardings[0])
    got = p.jit(forward)(sharded_params, jax.device_put(x, p.in_shardings[1]))
    np.testing.assert_allclose(
        np.asarray(got), np.asarray(forward(params, x)), rtol=1e-5, atol=1e-6
    )
    nnx.update(model, sharded_params)
    assert model.fc1.kernel[...].sharding.spec == p.param_specs["fc1"]["kernel"]


def test_one_dimensional_mesh_uses_fsdp_when_memory_demands(mesh8):
    m = zoo.build("gpt", layers=2, d_model=128, heads=4, seq_len=32, batch=8, vocab=256)
    roomy = plan(m.fn, m.params, *m.inputs, mesh=mesh8, hardware="tpu-v5e")
    assert roomy.input_paths[0]["arg1"] == ["data", None]
    assert all(spec == [None] * len(spec) for spec in roomy.param_paths.values())
    lowered, _ = lower(m.fn, m.params, *m.inputs, mesh=mesh8, hardware="tpu-v5e")
    floor = lowered.problem.min_memory()
    limit = floor + 0.25 * (roomy.predicted["peak_memory_bytes"] - floor)
    tight = plan(m.fn, m.params, *m.inputs, mesh=mesh8, memory_limit_bytes=limit)
    assert tight.predicted["peak_memory_bytes"] <= limit
    assert any("data" in spec for spec in tight.param_paths.values())  # ZeRO-3 style
