"""tapas_jax.shard and logical_axis_rules: a plan applied to an NNX model in one call."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen, nnx

import tapas_jax
from tapas_jax.placement import logical_annotations, logical_axis_rules, shard

D, HIDDEN, VOCAB, BATCH, SEQ = 128, 512, 1024, 8, 32


def _part(init, names):
    return nnx.with_partitioning(init, names)


class TinyLM(nnx.Module):
    """Embedding, one MLP and a head, annotated with MaxText-style logical axis names."""

    def __init__(self, rngs: nnx.Rngs):
        normal = nnx.initializers.normal(0.02)
        self.embed = nnx.Embed(
            VOCAB, D, embedding_init=_part(normal, ("vocab", "embed")), rngs=rngs
        )
        self.fc1 = nnx.Linear(
            D,
            HIDDEN,
            kernel_init=_part(normal, ("embed", "mlp")),
            bias_init=_part(nnx.initializers.zeros_init(), ("mlp",)),
            rngs=rngs,
        )
        self.fc2 = nnx.Linear(
            HIDDEN, D, kernel_init=_part(normal, ("mlp", "embed")), use_bias=False, rngs=rngs
        )
        self.ln = nnx.LayerNorm(D, rngs=rngs)
        self.head = nnx.Linear(
            D, VOCAB, kernel_init=_part(normal, ("embed", "vocab")), use_bias=False, rngs=rngs
        )

    def __call__(self, tokens):
        x = self.embed(tokens)
        x = x + self.fc2(jax.nn.gelu(self.fc1(x)))
        return self.head(self.ln(x))


@pytest.fixture(scope="module")
def planned(mesh_2x4):
    with nnx.use_eager_sharding(False):
        model = TinyLM(nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def step(params, tokens):
        """Next-token loss and one SGD update (the gradients make splitting the weights pay)."""

        def loss_fn(p):
            logits = nnx.merge(graphdef, p, rest)(tokens[:, :-1])
            logp = jax.nn.log_softmax(logits)
            return -jnp.take_along_axis(logp, tokens[:, 1:, None], -1).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        return loss, jax.tree.map(lambda w, g: w - 0.1 * g, params, grads)

    tokens = jax.random.randint(jax.random.key(1), (BATCH, SEQ), 0, VOCAB)
    p = tapas_jax.plan(step, params, tokens, mesh=mesh_2x4)
    return model, step, tokens, p


def test_shard_places_params_by_the_plan_and_keeps_outputs(planned, mesh_2x4):
    model, step, tokens, p = planned
    expected = jax.tree.map(np.asarray, step(nnx.state(model, nnx.Param), tokens))
    logits = np.asarray(model(tokens))
    assert tapas_jax.shard(model, p) is model
    state = nnx.state(model, nnx.Param)
    split = 0
    for path, var in nnx.to_flat_state(state):
        key = "/".join(map(str, path))
        spec = jax.sharding.PartitionSpec(*p.param_paths[key])
        want = jax.sharding.NamedSharding(mesh_2x4, spec)
        assert var[...].sharding.is_equivalent_to(want, var[...].ndim), key
        split += any(a is not None for a in spec)
    assert split >= 3, p.param_paths  # the plan splits the embedding, the MLP and the head
    got = p.jit(step)(state, tokens)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
        np.testing.assert_allclose(np.asarray(a), b, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(np.asarray(model(tokens)), logits, rtol=1e-4, atol=1e-6)


def test_shard_takes_a_plan_read_from_json(planned, mesh_2x4):
    model, *_, p = planned
    again = tapas_jax.Plan.from_json(p.to_json())
    with pytest.raises(ValueError, match="no concrete mesh"):
        shard(model, again)
    shard(model, again, mesh=mesh_2x4)
    kernel = model.fc1.kernel[...]
    assert kernel.sharding.spec == jax.sharding.PartitionSpec(*p.param_paths["fc1/kernel"])


def test_shard_rejects_another_model(planned):
    *_, p = planned
    with nnx.use_eager_sharding(False):
        other = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="differ from the plan"):
        shard(other, p)


def _names(model):
    """The model's logical names, the head's vocabulary under its own name: the plan splits the
    embedding's vocabulary but keeps the head whole, which one ``vocab`` name cannot say."""
    names = logical_annotations(model)
    names["head/kernel"] = ("embed", "head_vocab")
    return names


def test_logical_axis_rules_reproduce_the_plan(planned):
    model, _, _, p = planned
    names = logical_annotations(model)
    assert names["fc1/kernel"] == ("embed", "mlp")
    assert "ln/scale" not in names
    names = _names(model)
    rules = logical_axis_rules(p, names)
    assert len({n for n, _ in rules}) == len(rules)
    for path, spec in p.param_paths.items():
        if path in names:
            got = linen.logical_to_mesh_axes(names[path], rules)
            assert tuple(got) == tuple(spec), path


def test_logical_axis_rules_say_when_the_plan_is_finer(planned):
    model, _, _, p = planned
    names = _names(model)
    specs = dict(p.param_paths)
    specs["fc2/kernel"] = [None, "model"] if specs["fc2/kernel"][1] is None else [None, None]
    finer = dataclasses.replace(p, param_paths=specs)
    with pytest.raises(ValueError, match="logical axis 'embed'"):
        logical_axis_rules(finer, names)
    split = next(k for k, v in p.param_paths.items() if k in names and any(v))
    del names[split]
    with pytest.raises(ValueError, match=f"{split} is split .* no logical names"):
        logical_axis_rules(p, names)
