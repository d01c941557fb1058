"""``python -m tapas_jax <command>`` and the ``tapas`` console script (same commands)."""

import sys

from .commands import dispatch

COMMANDS = {
    "info": ("tapas_jax.info", "devices, a resolved mesh and the hardware profiles"),
    "plan": ("tapas_jax.cli", "plan the sharding of a zoo model on a mesh"),
    "verify": ("tapas_jax.cli", "compile a plan on the mesh and compare with its prediction"),
    "bench": ("tapas_jax.cli", "search time and plan cost against the integer-program baseline"),
}


def main(argv: list[str] | None = None) -> int:
    """The ``tapas`` console script and ``python -m tapas_jax``: runs a command."""
    return dispatch("tapas_jax", COMMANDS, sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())
