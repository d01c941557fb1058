"""``python -m tapas_jax <command>``."""

import sys

from .commands import dispatch

COMMANDS = {
    "info": ("tapas_jax.info", "devices, a resolved mesh and the hardware profiles"),
    "plan": ("tapas_jax.cli", "plan the sharding of a zoo model on a mesh"),
    "verify": ("tapas_jax.cli", "compile a plan on the mesh and compare with its prediction"),
    "bench": ("tapas_jax.cli", "search time and plan cost against the integer-program baseline"),
}

if __name__ == "__main__":
    sys.exit(dispatch("tapas_jax", COMMANDS, sys.argv[1:]))
