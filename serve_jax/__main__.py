"""``python -m serve_jax <command>`` and the ``serve-jax`` console script (same commands)."""

import sys

from tapas_jax.commands import dispatch

COMMANDS = {
    "serve": ("serve_jax.cli", "start the OpenAI-style HTTP server"),
    "replay": ("serve_jax.cli", "run the engine offline on a trace and report latency metrics"),
    "bench": ("serve_jax.cli", "load generator: replay a trace against a running server"),
    "simulate": ("serve_jax.simulate_cli", "compare preemption policies in the simulator"),
    "crosscheck": (
        "serve_jax.crosscheck_cli",
        "check the simulator against the real engine, policy by policy",
    ),
    "roofline-check": ("serve_jax.roofline_check", "roofline step times against the CPU engine"),
}


def main(argv: list[str] | None = None) -> int:
    """The ``serve-jax`` console script and ``python -m serve_jax``: runs a command."""
    return dispatch("serve_jax", COMMANDS, sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())
