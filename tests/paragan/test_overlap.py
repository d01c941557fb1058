"""The overlap of the ParaGAN step read from its compiled schedule (`paragan_jax.overlap`): the
real programs of both schemes compiled for this machine's CPU devices."""

import pytest

from paragan_jax import overlap as O
from paragan_jax.scaling import load_model_config, measure_step_costs, predict
from paragan_jax.scaling_check import CPU_CHECK_OVERRIDES


def test_cpu_compiled_step_of_each_scheme(capsys):
    """The real programs, compiled for 4 CPU devices: the CPU backend's collectives are all
    synchronous, so nothing is hidden; the sync step's D all-reduce has G's next work after it."""
    cfg = load_model_config("tiny", 4, CPU_CHECK_OVERRIDES)
    reports, info = O.read_schedule(cfg, "cpu:4", 4)
    assert set(reports) == {"sync", "async-g", "async-d"}
    assert info["devices"] == 4 and info["per_device_batch"] == 4  # two per async group
    for name, rep in reports.items():
        kinds = {c.kind for c in rep.collectives}
        assert "all-reduce" in kinds, name  # the gradient all-reduce
        assert not any(c.is_async for c in rep.collectives), name
        assert all(c.scheduled_share == 0.0 for c in rep.collectives)
        assert all(0.0 <= c.independent_share < 1.0 for c in rep.collectives)
        assert rep.total_flops > 0
    costs = measure_step_costs(cfg)
    for scheme in ("sync", "async"):
        row = predict(costs, 64, scheme, "tpu-v3")
        assert O.scheme_overlap(reports, row, "tpu-v3") == 0.0
        possible = O.scheme_overlap(reports, row, "tpu-v3", scheduled=False)
        assert 0.0 <= possible <= 1.0
    with pytest.raises(ValueError, match="schedule target"):
        O.read_schedule(cfg, "gpu", 4)
