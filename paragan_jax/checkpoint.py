"""Checkpoints of a paragan_jax run with Orbax's `CheckpointManager`, with SHA-256 integrity.

A checkpoint is one step directory ``<workdir>/checkpoints/<step>/`` holding two items and a
manifest:

- ``state``: the runner's checkpoint tree (a dict: ``{"train": TrainState}`` for the sync scheme;
  ``{"g": ..., "d": ..., "buffer": ...}`` for the async scheme, the generator side's D snapshot
  inside ``g`` and the fakes D has yet to read in ``buffer``), saved with `StandardSave` (sharded
  arrays are written by each process's shards, every process takes part; restored straight into
  the target shardings);
- ``meta``: JSON with the step, the data position (next batch index of the deterministic loader),
  the scheme, the config as a dict and ``state_keys`` (the top-level keys of ``state``);
- ``sha256.json``: the SHA-256 of every file of the step directory, written by process 0 once
  Orbax has finished the step (saves are asynchronous: at the next save, `wait` or `close`).

Orbax writes a step into a temporary directory and renames it when complete, so a run killed
mid-save leaves the previous checkpoints intact. `CheckpointStore.restore_latest` tries the newest
step first; if a file differs from its manifest (bit rot, a partial copy) or cannot be read (a
truncated file), it warns, moves that step aside to ``corrupt-<step>`` (so the run can save that
step number again) and falls back to the previous one. A step without a manifest (written before
checksums existed, or killed between Orbax's commit and the manifest) restores with a log line.

Directories are `etils.epath` paths, so a workdir may be ``gs://bucket/run`` (Orbax writes through
the same library). Keys of the target that an older checkpoint lacks (listed in ``optional``)
are left out of the restore and named in ``Restored["missing"]``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import warnings
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils

__all__ = [
    "ChecksumError",
    "CheckpointStore",
    "Restored",
    "abstract_like",
    "as_path",
    "tree_sha256",
]

log = logging.getLogger("paragan_jax")

MANIFEST = "sha256.json"


class ChecksumError(ValueError):
    """A checkpoint file does not match the SHA-256 recorded when it was saved."""


def as_path(path: str | os.PathLike) -> epath.Path:
    """An `etils.epath.Path` for a local or ``gs://`` path; local paths made absolute (Orbax
    needs absolute directories), remote ones left as they are."""
    p = epath.Path(path)
    return p if "://" in str(path) else p.resolve()


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


def tree_sha256(tree: Any) -> str:
    """SHA-256 over every array of `tree` in tree order (dtype, shape, then the bytes of each;
    arrays spread over processes are gathered first)."""
    h = hashlib.sha256()
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
            leaf = multihost_utils.process_allgather(leaf, tiled=True)
        a = np.ascontiguousarray(jax.device_get(leaf))
        h.update(f"{a.dtype.str}{a.shape}".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def _file_sha256(path: epath.Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _files(root: epath.Path) -> list[str]:
    """Paths of every file under `root`, relative to it, sorted (the manifest excluded)."""
    out = []
    for dirpath, _, names in root.walk():
        for name in names:
            rel = os.path.relpath(str(epath.Path(dirpath) / name), str(root))
            if rel != MANIFEST:
                out.append(rel)
    return sorted(out)


class Restored(dict):
    """``{"state", "meta", "step", "missing"}`` returned by `CheckpointStore`: ``missing`` lists
    the optional top-level state keys the checkpoint did not have."""


class CheckpointStore:
    """Save every N steps, keep the last K, restore the newest intact one."""

    def __init__(self, directory: str | os.PathLike, keep: int = 3, every: int = 1):
        """Opens (creating if needed) a checkpoint directory, local or ``gs://``.

        Args:
          directory: where step directories live.
          keep: how many of the newest checkpoints to keep.
          every: `should_save(step)` is true on multiples of this.
        """
        self.directory = as_path(directory)
        self.every = every
        if jax.process_index() == 0:
            self.directory.mkdir(parents=True, exist_ok=True)
        self._options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True)
        self._manager = self._open()
        self._unhashed: list[int] = []  # saved steps whose manifest is not written yet

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

    def save(self, step: int, state: dict[str, Any], meta: dict[str, Any], force=False) -> bool:
        """Starts saving `state` and `meta` at `step` (asynchronously); returns whether it did.
        Every process must call it (each writes its own shards)."""
        self._write_manifests(block=False)
        if step in self._manager.all_steps():
            return False
        meta = {**meta, "state_keys": sorted(state)}
        saved = self._manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)
            ),
            force=force,
        )
        if saved:
            self._unhashed.append(step)
            log.info("checkpoint: saving step %d to %s", step, self.directory)
        return bool(saved)

    def _write_manifests(self, block: bool) -> None:
        """Writes ``sha256.json`` of every finished save (waits for them when `block`)."""
        if not self._unhashed:
            return
        if block:
            self._manager.wait_until_finished()
        elif self._manager.is_saving_in_progress():
            return
        if jax.process_index() == 0:
            for step in self._unhashed:
                root = self.directory / str(step)
                if root.exists():  # not already rotated out by max_to_keep
                    digests = {rel: _file_sha256(root / rel) for rel in _files(root)}
                    (root / MANIFEST).write_text(json.dumps(digests, indent=0, sort_keys=True))
        self._unhashed.clear()

    def wait(self) -> None:
        """Blocks until pending saves (and their manifests) are on disk."""
        self._write_manifests(block=True)
        self._manager.wait_until_finished()

    def verify(self, step: int) -> bool:
        """Checks the files of `step` against its manifest.

        Returns:
          False if the step has no manifest (nothing to check), True if every file matches.

        Raises:
          ChecksumError: a file is missing or differs (named in the message).
        """
        root = self.directory / str(step)
        manifest = root / MANIFEST
        if not manifest.exists():
            return False
        digests = json.loads(manifest.read_text())
        for rel, digest in sorted(digests.items()):
            f = root / rel
            if not f.exists():
                raise ChecksumError(f"{rel} is missing")
            if _file_sha256(f) != digest:
                raise ChecksumError(f"{rel} does not match its SHA-256 in {MANIFEST}")
        return True

    def restore(self, step: int, target: dict[str, Any], optional=()) -> Restored:
        """Verifies `step` and restores it into the structure and shardings of `target`.

        Args:
          step: the step to restore.
          target: the runner's checkpoint tree (arrays or ShapeDtypeStructs), a dict.
          optional: top-level keys of `target` an older checkpoint may lack (restored without
            them, named in ``missing``).

        Raises:
          ChecksumError: a file differs from its manifest; any Orbax error of an unreadable step.
        """
        if not self.verify(step):
            log.info("checkpoint step %d has no %s: restoring it unverified", step, MANIFEST)
        meta = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        meta = dict(meta["meta"])
        saved = meta.get("state_keys")
        if saved is None:  # written before state_keys: everything but the optional keys
            saved = [k for k in target if k not in optional]
        missing = [k for k in target if k not in saved and k in optional]
        sub = {k: v for k, v in target.items() if k not in missing}
        out = self._manager.restore(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_like(sub))),
        )
        return Restored(state=dict(out["state"]), meta=meta, step=step, missing=missing)

    def restore_latest(self, target: dict[str, Any], optional=()) -> Restored | None:
        """The newest intact checkpoint, falling back past corrupt ones with a warning.

        Returns:
          The restored checkpoint, or None if there is none.
        """
        self.wait()
        for step in reversed(self.steps()):
            try:
                return self.restore(step, target, optional)
            except Exception as e:  # any read/parse/checksum error means this step is unusable
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
                dst.rmtree()
            if src.exists():
                src.rename(dst)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(f"paragan_quarantine_{step}")
        self._manager.close()
        self._manager = self._open()

    def close(self) -> None:
        """Waits for pending saves, writes their manifests and releases the manager."""
        self.wait()
        self._manager.close()
