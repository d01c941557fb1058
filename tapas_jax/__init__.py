"""tapas_jax: the sharding layer of the stack.

Meshes (`tapas_jax.mesh`), hardware profiles (`tapas_jax.hardware`), the collective cost model
(`tapas_jax.collectives`) and typed configs (`tapas_jax.config`) used by every package, and the
automatic tensor-parallelism planner: `plan(fn, params, *inputs, mesh=...)` returns a `Plan` of
PartitionSpecs (`tapas_jax.planner`); `verify` compiles it and checks it (`tapas_jax.verification`).

Public names are imported lazily, so ``python -m <package>`` can set up the simulated CPU devices
(`tapas_jax.commands`) before jax is first imported.
"""

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what the lazy exports below resolve to, for type checkers
    from .collectives import collective_seconds
    from .config import ConfigError, load_config
    from .fold import fold_repeated_blocks
    from .graph import build_graph
    from .hardware import HardwareProfile, get_profile
    from .mesh import MeshSpecError, abstract_mesh, make_mesh, split_mesh
    from .placement import logical_axis_rules, shard
    from .planner import Plan, plan
    from .search import MemoryInfeasibleError
    from .verification import VerifyResult, verify

_EXPORTS = {
    "ConfigError": ".config",
    "load_config": ".config",
    "HardwareProfile": ".hardware",
    "get_profile": ".hardware",
    "collective_seconds": ".collectives",
    "MeshSpecError": ".mesh",
    "abstract_mesh": ".mesh",
    "make_mesh": ".mesh",
    "split_mesh": ".mesh",
    "Plan": ".planner",
    "plan": ".planner",
    "shard": ".placement",
    "logical_axis_rules": ".placement",
    "verify": ".verification",
    "VerifyResult": ".verification",
    "MemoryInfeasibleError": ".search",
    "build_graph": ".graph",
    "fold_repeated_blocks": ".fold",
}

__all__ = [  # the keys of _EXPORTS (a literal list, so tools see the names)
    "ConfigError",
    "HardwareProfile",
    "MemoryInfeasibleError",
    "MeshSpecError",
    "Plan",
    "VerifyResult",
    "abstract_mesh",
    "build_graph",
    "collective_seconds",
    "fold_repeated_blocks",
    "get_profile",
    "load_config",
    "logical_axis_rules",
    "make_mesh",
    "plan",
    "shard",
    "split_mesh",
    "verify",
]


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    raise AttributeError(f"module 'tapas_jax' has no attribute {name!r}")
