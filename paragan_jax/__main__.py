"""``python -m paragan_jax <command>`` and the ``paragan`` console script (same commands)."""

import sys

from tapas_jax.commands import Command, dispatch

COMMANDS = {
    "train": ("paragan_jax.cli", "train a GAN from a preset (sync or async scheme)"),
    "eval": ("paragan_jax.cli", "offline metrics of the latest checkpoint"),
    "sample": ("paragan_jax.cli", "write a sample grid PNG from the latest checkpoint"),
    "bench": ("paragan_jax.cli", "async against sync: steps/s and quality at equal time"),
    "bench-pipeline": ("paragan_jax.pipeline_bench", "fixed vs adaptive input pipeline"),
    "bench-step": ("paragan_jax.step_bench", "time of one training step (the PyTorch peer's)"),
    "prepare": ("paragan_jax.prepare", "write images / npy / digits as sharded uint8 on disk"),
    "scaling": ("paragan_jax.scale_cli", "predicted step time and scaling efficiency at scale"),
    "layout": ("paragan_jax.layout_bench", "padding waste and CPU time of three stem layouts"),
    "async-worker": Command("paragan_jax.distributed", "an async-scheme process", internal=True),
    "scaling-worker": Command("paragan_jax.scaling_check", "a CPU-check process", internal=True),
    "train-multihost": Command("paragan_jax.scale_cli", "train on a TPU VM worker", internal=True),
}


def main(argv: list[str] | None = None) -> int:
    """The ``paragan`` console script and ``python -m paragan_jax``: runs a command."""
    return dispatch("paragan_jax", COMMANDS, sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())
