"""The plan and verify commands end to end: compiled collectives and numerics on 8 CPU devices."""

import json

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from tapas_jax import cli
from tapas_jax.__main__ import COMMANDS
from tapas_jax.commands import dispatch
from tapas_jax.constraints import constrained
from tapas_jax.search import MemoryInfeasibleError
from tapas_jax.verification import count_collectives

GPT_FLAGS = [
    "--model",
    "gpt",
    "--layers",
    "2",
    "--d-model",
    "128",
    "--heads",
    "4",
    "--seq-len",
    "64",
    "--batch",
    "8",
    "--vocab",
    "256",
    "--mesh",
    "data=2,model=4",
]


@pytest.fixture(scope="module")
def verify_json(tmp_path_factory):
    path = tmp_path_factory.mktemp("verify") / "verify.json"
    assert cli.main(["verify", *GPT_FLAGS, "--json", str(path)]) == 0
    return json.loads(path.read_text())


def test_verify_gpt_matches_prediction_and_numerics(verify_json):
    d = verify_json
    assert {"predicted_comm_bytes", "compiled_comm_bytes", "collectives", "max_abs_error"} <= set(d)
    assert d["max_rel_error"] <= 1e-5
    assert d["collectives"].get("all-reduce", 0) >= 1
    assert d["compiled_comm_bytes"] == pytest.approx(d["predicted_comm_bytes"], rel=0.10)
    # tensor parallelism is in the verified plan, not only data parallelism
    assert d["plan"]["param_specs"]["blocks/0/mlp/fc1/kernel"] == [None, "model"]


def test_plan_command_json_keys(tmp_path, capsys):
    path = tmp_path / "plan.json"
    assert cli.main(["plan", "--config", "gpt_tiny_cpu", "--json", str(path)]) == 0
    d = json.loads(path.read_text())
    assert d["fold"]["layers"] == 2 and d["fold"]["unique_blocks"] >= 1
    assert {"comm_bytes", "step_seconds", "peak_memory_bytes"} <= set(d["predicted"])
    assert d["search_seconds"] > 0
    assert all(isinstance(v, list) for v in d["param_specs"].values())
    out = capsys.readouterr().out
    assert "predicted step" in out and "fold:" in out


def test_plan_command_memory_error(tmp_path, capsys):
    argv = ["plan", "--config", "gpt_tiny_cpu", "--memory-limit-gib", "1e-6"]
    with pytest.raises(MemoryInfeasibleError, match="smallest memory that would fit"):
        cli.main(argv)
    assert dispatch("tapas_jax", COMMANDS, argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "smallest memory that would fit" in err


def test_collectives_in_a_while_body_count_once_per_trip():
    hlo = """
%body.1 (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %ar = f32[8]{0} all-reduce(%x), replica_groups=[4,2]<=[8], to_apply=%add
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %w = (s32[], f32[8]) while(%t), condition=%cond.1, body=%body.1, TRIPS
}
"""
    hlo = hlo.replace("TRIPS", 'backend_config={"known_trip_count":{"n":"3"}}')
    counts, moved = count_collectives(hlo, 8)
    assert counts == {"all-reduce": 3}
    assert moved["all-reduce"] == pytest.approx(3 * 2 * 0.5 * 8 * 4)


def test_count_collectives_reads_tuples_and_mesh_groups():
    hlo = """
ENTRY %main {
  %ar = (f32[64]{0}, f32[64,64]{1,0}) all-reduce(%a, %b), GROUPS, to_apply=%add
  %ag = f32[8,128]{1,0} all-gather(%c), replica_groups=[2,4]<=[8], dimensions={0}
  %rs = f32[2,128]{1,0} reduce-scatter(%d), replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}
}
"""
    hlo = hlo.replace("GROUPS", "replica_groups=mesh['x'=2,'y'=4] {'x'}")
    counts, moved = count_collectives(hlo, 8)
    assert counts == {"all-reduce": 1, "all-gather": 1, "reduce-scatter": 1}
    assert moved["all-reduce"] == pytest.approx(2 * 0.5 * (64 + 64 * 64) * 4)
    assert moved["all-gather"] == pytest.approx(0.75 * 8 * 128 * 4)
    assert moved["reduce-scatter"] == pytest.approx(0.75 * 4 * 2 * 128 * 4)


def test_operand_pins_make_xla_gather_rather_than_all_reduce(mesh_2x4):
    """A contraction the plan prices as gathering both operands compiles to all-gathers."""

    def fn(w, x):
        return jnp.dot(x, w)

    split = (NamedSharding(mesh_2x4, P("model", None)), NamedSharding(mesh_2x4, P(None, "model")))
    out = NamedSharding(mesh_2x4, P())
    w, x = jnp.ones((256, 64)), jnp.ones((32, 256))
    counts = {}
    for name, pins in {
        "unpinned": {"0": [None, None]},
        "pinned": {"0": [None, None], "0@0": [None, None], "0@1": [None, None]},
    }.items():
        f = jax.jit(constrained(fn, pins, mesh_2x4), in_shardings=split, out_shardings=out)
        hlo = f.lower(w, x).compile().as_text()
        counts[name] = count_collectives(hlo, 8)[0]
        assert float(f(w, x)[0, 0]) == pytest.approx(256.0)
    # XLA's own choice for a replicated result of contraction-split operands: an all-reduce
    assert counts["unpinned"].get("all-reduce", 0) >= 1
    # with the operands pinned replicated, as priced: gathers and no partial-sum reduction
    assert counts["pinned"].get("all-gather", 0) >= 1
    assert counts["pinned"].get("all-reduce", 0) == 0


@pytest.mark.slow
def test_verify_gpt_4_layers_d256_within_10_percent(tmp_path):
    path = tmp_path / "v.json"
    flags = ["--model", "gpt", "--layers", "4", "--mesh", "data=2,model=4"]
    assert cli.main(["verify", *flags, "--json", str(path)]) == 0
    d = json.loads(path.read_text())
    assert d["compiled_comm_bytes"] == pytest.approx(d["predicted_comm_bytes"], rel=0.10)
    # the contractions priced as operand all-gathers are pinned so, not left to XLA
    assert any("@" in k for k in d["plan"]["constraints"])
