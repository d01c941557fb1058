"""The JAX executor's sampling contract (`serve_jax.executor`): a chunk samples through the
engine's `SequenceSampling` (one path, full sampler when its parameters need it: the engine
tests in test_sampling.py run it) or greedily; anything else is refused by name rather than
sampled with part of its parameters."""

from __future__ import annotations

import pytest

from serve_jax.executor import JaxExecutor
from serve_jax.interface import ScheduledChunk, SchedulerOutput
from serve_jax.model import init_model
from serve_jax.model_config import get_model_config
from serve_jax.sampling import SamplingParams


@pytest.fixture(scope="module")
def executor():
    model = init_model(get_model_config("tiny", max_seq_len=64), seed=0)
    return JaxExecutor(model, num_device_blocks=8, block_size=16, use_host_tier=False)


def _step(sampling) -> SchedulerOutput:
    out = SchedulerOutput(step=0)
    out.prefills = [ScheduledChunk("r", 0, 4, (1, 5, 6, 7), True, 0, sampling)]
    out.block_tables = {"r": [0]}
    return out


def test_a_bare_sampling_params_is_refused_by_name(executor):
    """A bare SamplingParams once took the plain path whatever it asked for (top-k, penalties
    dropped silently; logprobs crashed on the missing sampler output)."""
    for params in (SamplingParams(top_k=2, temperature=1.0), SamplingParams(logprobs=2)):
        with pytest.raises(TypeError, match="request 'r'.*SequenceSampling.*SamplingParams"):
            executor.execute(_step(params))
