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
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what the lazy exports below resolve to, for type checkers
    from paragan_jax.config import TrainConfig, load_train_config
    from paragan_jax.loop import run_steps
    from paragan_jax.models import build_models
    from paragan_jax.state import make_train_state
    from paragan_jax.steps import SyncRunner, make_sync_step
    from paragan_jax.train import Trainer

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

__all__ = [  # the keys of _EXPORTS (a literal list, so tools see the names)
    "SyncRunner",
    "TrainConfig",
    "Trainer",
    "build_models",
    "load_train_config",
    "make_sync_step",
    "make_train_state",
    "run_steps",
]


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    raise AttributeError(f"module 'paragan_jax' has no attribute {name!r}")
