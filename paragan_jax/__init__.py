"""paragan_jax: scalable GAN training in Flax NNX with synchronous and asynchronous G/D updates.

Public names are imported lazily so that ``python -m paragan_jax`` can set up the simulated CPU
devices before jax is imported, and ``import paragan_jax`` stays cheap:

- `TrainConfig`, `load_train_config` (`paragan_jax.config`);
- `Trainer` (`paragan_jax.train`): ``Trainer(config, workdir).train()``;
- `build_models` (`paragan_jax.models`), `make_train_state` (`paragan_jax.state`),
  `make_sync_step` and `SyncRunner` (`paragan_jax.steps`), `run_steps` (`paragan_jax.loop`, the
  one step loop); the async scheme is `paragan_jax.async_scheme.AsyncRunner` (one process) and
  `paragan_jax.distributed.run_two_process_async` (two processes).
"""

import importlib

_EXPORTS = {
    "TrainConfig": ".config",
    "load_train_config": ".config",
    "build_models": ".models",
    "Trainer": ".train",
    "SyncRunner": ".steps",
    "make_train_state": ".state",
    "make_sync_step": ".steps",
    "run_steps": ".loop",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    raise AttributeError(f"module 'paragan_jax' has no attribute {name!r}")
