"""Checkpoints of a paragan_jax run with Orbax's `CheckpointManager`.

A checkpoint is one step directory ``<workdir>/checkpoints/<step>/`` holding two items:

- ``state``: the whole `TrainState` (G, D, EMA, both optimizer states, step, RNG key), plus for the
  async scheme the generator side's D snapshot, saved with `StandardSave` (sharded arrays are
  written by each process's shards; restored straight into the target shardings);
- ``meta``: JSON with the step, the data position (next batch index of the deterministic loader),
  the scheme and the config as a dict.

Orbax writes a step into a temporary directory and renames it when complete, so a run killed
mid-save leaves the previous checkpoints intact (saves are asynchronous: `close` waits for the
last). `CheckpointStore.restore_latest` tries the newest step first; if it cannot be read (a
corrupted or truncated file), it warns, moves that step aside to ``corrupt-<step>`` (so the run can
save that step number again) and falls back to the previous one.
"""

from __future__ import annotations

import logging
import shutil
import warnings
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

__all__ = ["CheckpointStore", "Restored", "abstract_like"]

log = logging.getLogger("paragan_jax")


def abstract_like(tree: Any, shardings: Any | None = None) -> Any:
    """ShapeDtypeStructs (with shardings) describing `tree`, the restore target."""
    if shardings is None:
        return jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
            tree,
        )
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
    )


class Restored(dict):
    """``{"state": pytree, "meta": dict, "step": int}`` returned by `CheckpointStore`."""


class CheckpointStore:
    """Save every N steps, keep the last K, restore the newest readable one."""

    def __init__(self, directory: str | Path, keep: int = 3, every: int = 1):
        """Opens (creating if needed) a checkpoint directory.

        Args:
          directory: where step directories live.
          keep: how many of the newest checkpoints to keep.
          every: `should_save(step)` is true on multiples of this.
        """
        self.directory = Path(directory).absolute()
        self.every = every
        self.directory.mkdir(parents=True, exist_ok=True)
        self._options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True)
        self._manager = self._open()

    def _open(self) -> ocp.CheckpointManager:
        return ocp.CheckpointManager(
            self.directory, item_names=("state", "meta"), options=self._options
        )

    def should_save(self, step: int) -> bool:
        """True when `step` is a multiple of the save interval."""
        return step > 0 and step % self.every == 0

    def steps(self) -> list[int]:
        """Steps with a finished checkpoint, oldest first."""
        return sorted(self._manager.all_steps())

    def save(self, step: int, state: Any, meta: dict[str, Any], force: bool = False) -> bool:
        """Starts saving `state` and `meta` at `step` (asynchronously); returns whether it did."""
        if step in self._manager.all_steps():
            return False
        saved = self._manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)
            ),
            force=force,
        )
        if saved:
            log.info("checkpoint: saving step %d to %s", step, self.directory)
        return bool(saved)

    def wait(self) -> None:
        """Blocks until pending saves are on disk."""
        self._manager.wait_until_finished()

    def restore(self, step: int, target: Any) -> Restored:
        """Restores `step` into the structure and shardings of `target` (arrays or structs)."""
        out = self._manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_like(target)),
                meta=ocp.args.JsonRestore(),
            ),
        )
        return Restored(state=out["state"], meta=dict(out["meta"]), step=step)

    def restore_latest(self, target: Any) -> Restored | None:
        """The newest readable checkpoint, falling back past unreadable ones with a warning.

        Returns:
          The restored checkpoint, or None if there is none.
        """
        self.wait()
        for step in reversed(self.steps()):
            try:
                return self.restore(step, target)
            except Exception as e:  # any read/parse error means this step is unusable
                msg = (
                    f"checkpoint step {step} in {self.directory} cannot be restored "
                    f"({type(e).__name__}: {str(e).splitlines()[0][:200]}); moving it to "
                    f"corrupt-{step} and falling back to the previous checkpoint"
                )
                warnings.warn(msg, RuntimeWarning, stacklevel=2)
                log.warning(msg)
                self._quarantine(step)
        return None

    def _quarantine(self, step: int) -> None:
        if jax.process_index() == 0:
            src = self.directory / str(step)
            dst = self.directory / f"corrupt-{step}"
            if dst.exists():
                shutil.rmtree(dst)
            if src.exists():
                src.rename(dst)
        self._manager.close()
        self._manager = self._open()

    def close(self) -> None:
        """Waits for pending saves and releases the manager."""
        self._manager.wait_until_finished()
        self._manager.close()
