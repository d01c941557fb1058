"""serve_jax: LLM serving with a paged KV cache, a host tier and cascade-avoiding preemption.

Public names are imported lazily so ``import serve_jax`` stays cheap (no JAX until needed)::

    from serve_jax import Engine, SamplingParams, load_engine_config

The one engine loop is `EngineCore` (``serve_jax.core``): the JAX `Engine` and the simulator
(``serve_jax.simulator.simulate``) are that loop with different executors plugged in.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what the lazy exports below resolve to, for type checkers
    from serve_jax.config import EngineConfig, load_engine_config
    from serve_jax.core import EngineCore, StepOutput
    from serve_jax.engine import Engine, RequestOutput
    from serve_jax.interface import (
        CostHints,
        ExecutorOutput,
        FcfsLastPolicy,
        PreemptMode,
        Request,
        RequestStatus,
        SchedulerOutput,
        SchedulerView,
        VictimPolicy,
    )
    from serve_jax.kv_blocks import KVBlockManager
    from serve_jax.model import init_model
    from serve_jax.model_config import ModelConfig, get_model_config
    from serve_jax.sampling import SamplingParams
    from serve_jax.scheduler import Scheduler
    from serve_jax.simulator import SimConfig, simulate

_EXPORTS = {
    "Engine": "serve_jax.engine",
    "RequestOutput": "serve_jax.engine",
    "EngineCore": "serve_jax.core",
    "StepOutput": "serve_jax.core",
    "SamplingParams": "serve_jax.sampling",
    "EngineConfig": "serve_jax.config",
    "load_engine_config": "serve_jax.config",
    "Scheduler": "serve_jax.scheduler",
    "SchedulerOutput": "serve_jax.interface",
    "ExecutorOutput": "serve_jax.interface",
    "Request": "serve_jax.interface",
    "RequestStatus": "serve_jax.interface",
    "PreemptMode": "serve_jax.interface",
    "VictimPolicy": "serve_jax.interface",
    "FcfsLastPolicy": "serve_jax.interface",
    "SchedulerView": "serve_jax.interface",
    "CostHints": "serve_jax.interface",
    "KVBlockManager": "serve_jax.kv_blocks",
    "ModelConfig": "serve_jax.model_config",
    "get_model_config": "serve_jax.model_config",
    "init_model": "serve_jax.model",
    "SimConfig": "serve_jax.simulator",
    "simulate": "serve_jax.simulator",
}

__all__ = [  # the keys of _EXPORTS (a literal list, so tools see the names)
    "CostHints",
    "Engine",
    "EngineConfig",
    "EngineCore",
    "ExecutorOutput",
    "FcfsLastPolicy",
    "KVBlockManager",
    "ModelConfig",
    "PreemptMode",
    "Request",
    "RequestOutput",
    "RequestStatus",
    "SamplingParams",
    "Scheduler",
    "SchedulerOutput",
    "SchedulerView",
    "SimConfig",
    "StepOutput",
    "VictimPolicy",
    "get_model_config",
    "init_model",
    "load_engine_config",
    "simulate",
]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'serve_jax' has no attribute {name!r}")
