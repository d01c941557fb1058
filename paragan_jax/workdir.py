"""What a training run needs around its workdir on one host or many: the directory, a lock, and a
preemption watch.

- `prepare_workdir`: the workdir as an `etils.epath.Path` (local, or ``gs://bucket/run``: never
  through ``pathlib``, which would turn ``gs://`` into a local ``gs:/``), created and probed for
  writing by process 0.
- `WorkdirLock`: ``<workdir>/paragan.lock`` (pid and host of the run's process 0) refuses a second
  run on the same workdir with one `OSError` line (the CLI's exit 2): two runs would race in
  Orbax's temporary directories. A lock left by a process that is gone (same host, dead pid) is
  taken over with a log line. The lock is advisory on ``gs://`` (no atomic create there).
- `PreemptionWatch`: a SIGTERM (a spot/preemptible VM's notice, or ``kill``) asks the run to stop
  at a step boundary, save a checkpoint there and exit 0. With several processes joined by
  `jax.distributed` the decision is JAX's preemption sync point
  (`jax.experimental.multihost_utils.reached_preemption_sync_point`: the runtime's preemption
  service catches SIGTERM on any host and all hosts agree on the step to stop at); in a single
  process a Python signal handler sets a flag checked after each step.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
from typing import Any

import jax
from etils import epath
from jax.experimental import multihost_utils

from .checkpoint import as_path

__all__ = ["LOCK_NAME", "PreemptionWatch", "WorkdirLock", "is_primary", "prepare_workdir"]

log = logging.getLogger("paragan_jax")

LOCK_NAME = "paragan.lock"


def is_primary() -> bool:
    """True in process 0, the one that writes logs, TensorBoard, config and images."""
    return jax.process_index() == 0


def prepare_workdir(workdir: str | os.PathLike) -> epath.Path:
    """The workdir as an epath, created (by process 0) and checked to be writable.

    Raises:
      OSError: it cannot be created or written (the message names the workdir).
    """
    path = as_path(workdir)
    if not is_primary():
        return path
    try:
        if path.exists() and not path.is_dir():
            raise NotADirectoryError(20, "Not a directory")
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".paragan_write_test"
        probe.write_bytes(b"")
        probe.unlink()
    except ImportError as e:  # fsspec without its gs:// (or s3://) backend
        raise OSError(
            f"workdir {str(workdir)!r}: {e} (pip install 'etils[epath-gcs]'; the tpu extra has it)"
        ) from None
    except OSError as e:
        reason = e.strerror or type(e).__name__
        raise OSError(f"workdir {str(workdir)!r} is not a writable directory ({reason})") from None
    return path


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


class WorkdirLock:
    """``<workdir>/paragan.lock`` held by process 0 for the length of a run (a context manager).

    Raises (on enter):
      OSError: another live run holds the workdir (its pid and host are named).
    """

    def __init__(self, workdir: epath.Path):
        self.path = workdir / LOCK_NAME
        self.held = False

    def _owner(self) -> dict[str, Any] | None:
        try:
            return json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {}  # unreadable or half-written: treated as held by an unknown run

    def _create(self) -> bool:
        text = json.dumps({"pid": os.getpid(), "host": socket.gethostname()})
        if "://" in str(self.path):  # object stores have no exclusive create
            if self.path.exists():
                return False
            self.path.write_text(text)
            return True
        try:
            fd = os.open(str(self.path), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            f.write(text)
        return True

    def __enter__(self) -> WorkdirLock:
        if not is_primary():
            return self
        for _ in range(2):
            if self._create():
                self.held = True
                return self
            owner = self._owner()
            if owner is None:
                continue  # released in between: try again
            pid, host = owner.get("pid"), owner.get("host")
            if host == socket.gethostname() and isinstance(pid, int) and not _pid_alive(pid):
                log.warning("taking over the stale lock %s of pid %d (not running)", self.path, pid)
                self.path.unlink(missing_ok=True)
                continue
            who = f"pid {pid} on {host}" if pid else "an unknown run"
            raise OSError(
                f"workdir {str(self.path.parent)!r} is in use by another run ({who}); "
                f"wait for it to finish or remove {self.path} if it is gone"
            )
        raise OSError(f"could not take the lock {self.path}")

    def __exit__(self, *exc) -> None:
        if self.held:
            self.path.unlink(missing_ok=True)
            self.held = False


class PreemptionWatch:
    """Whether a SIGTERM asked the run to stop (see the module doc); a context manager that
    installs the single-process handler and restores the previous one on exit."""

    def __init__(self):
        self.multi = jax.process_count() > 1
        self._flag = False
        self._previous: Any = None
        self.stopped_at: int | None = None

    def _handler(self, signum, frame) -> None:
        self._flag = True

    def __enter__(self) -> PreemptionWatch:
        if not self.multi:  # JAX's preemption service owns SIGTERM in a distributed runtime
            self._previous = signal.signal(signal.SIGTERM, self._handler)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def should_stop(self, step: int) -> bool:
        """Called after every step (`step` = G steps done, the same on every process)."""
        if self.multi:
            stop = multihost_utils.reached_preemption_sync_point(step)
        else:
            stop = self._flag
        if stop and self.stopped_at is None:
            self.stopped_at = step
        return stop
