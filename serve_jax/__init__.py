"""serve_jax: LLM serving with a paged KV cache, a host tier and cascade-avoiding preemption.

Public names are imported lazily so ``import serve_jax`` stays cheap (no JAX until needed)::

    from serve_jax import Engine, SamplingParams, load_engine_config
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "Engine": "serve_jax.engine",
    "RequestOutput": "serve_jax.engine",
    "SamplingParams": "serve_jax.sampling",
    "EngineConfig": "serve_jax.config",
    "load_engine_config": "serve_jax.config",
    "Scheduler": "serve_jax.scheduler",
    "SchedulerOutput": "serve_jax.scheduler",
    "ExecutorOutput": "serve_jax.scheduler",
    "Request": "serve_jax.scheduler",
    "RequestStatus": "serve_jax.scheduler",
    "PreemptMode": "serve_jax.scheduler",
    "VictimPolicy": "serve_jax.scheduler",
    "FcfsLastPolicy": "serve_jax.scheduler",
    "SchedulerView": "serve_jax.scheduler",
    "CostHints": "serve_jax.scheduler",
    "KVBlockManager": "serve_jax.kv_blocks",
    "ModelConfig": "serve_jax.model_config",
    "get_model_config": "serve_jax.model_config",
    "init_model": "serve_jax.model",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'serve_jax' has no attribute {name!r}")
