"""Multi-process launcher and the two-process asynchronous scheme (one process per group).

`launch` starts N local processes of an internal command (``python -m paragan_jax <command>
--process-id i --num-processes N --port P ...``) that join one JAX runtime with `initialize`
(`jax.distributed.initialize`, coordinator on 127.0.0.1, gloo CPU collectives), the way hosts of
a TPU pod do. Two commands run this way: ``async-worker`` (here) and ``scaling-worker``
(`paragan_jax.scaling_check`).

The async worker runs `paragan_jax.async_scheme`'s schedule with process 0 as the generator group
and process 1 as the discriminator group, each data parallel over its own local devices, through
the one step loop (`paragan_jax.loop.run_steps`, runner `ProcessPairRunner`):

- fake batches go G -> D and D snapshots go D -> G through
  `jax.experimental.multihost_utils.process_allgather` (a gloo all-gather across the processes;
  both processes call the exchanges in the same order, fixed by the schedule);
- per iteration: [every k iterations: D sends its params, G installs them as its snapshot];
  both groups dispatch their step (G: update against the snapshot, then fakes of the new G; D:
  update on a real batch and the fakes received in the previous exchange); then the fakes (and a
  stop flag decided by process 0's loop) are exchanged. D's step runs while process 1 waits in
  that exchange for G's fakes, so the two steps overlap in wall-clock time;
- ``k = 0`` runs D's step, sends the updated D, then G's step: the synchronous schedule.

Process 0 writes ``result.json`` (steps, steps/s, each side's ``state_sha256``) and
``samples.npy`` (EMA generator) into the output directory; `run_two_process_async` launches the
pair and reads them back.

Checkpoints (``run_two_process_async(..., checkpoint=True)``, worker flag ``--checkpoint``): right
after the exchange of every ``checkpoint.every``-th iteration and at the end (nothing in flight),
each side packs its host copy (G: its state with the D snapshot; D: its state and the fakes it
trains on next) into bytes, the two are all-gathered, and both processes save ``{"g", "d"}`` into
one `paragan_jax.checkpoint.CheckpointStore` under ``<out>/checkpoints`` (every process takes
part, as Orbax expects; process 0 writes). A rerun restores the newest intact iteration (both
processes read the same step, so they agree) and continues bit for bit; the data position is
``iteration * n_disc``.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from tapas_jax.mesh import make_mesh

from .async_scheme import build_d_side, build_g_side
from .checkpoint import CheckpointStore, tree_sha256
from .config import TrainConfig, load_train_config
from .data import PrefetchLoader, device_batch, load_dataset
from .loop import grouped, run_steps
from .state import check_batch_divides
from .steps import compile_step, sample_images, stack_batches

__all__ = [
    "ProcessPairRunner",
    "WorkerFailed",
    "async_worker",
    "free_port",
    "initialize",
    "launch",
    "main",
    "run_two_process_async",
]

WORKER_COMMAND = "async-worker"


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def initialize(process_id: int, num_processes: int, port: int) -> None:
    """Joins this process to a local multi-process JAX runtime with gloo CPU collectives."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=num_processes,
        process_id=process_id,
    )


class WorkerFailed(RuntimeError):
    """A launched worker exited with a non-zero status (``returncode``) or timed out."""

    def __init__(self, message: str, returncode: int):
        super().__init__(message)
        self.returncode = returncode


def launch(
    worker_args: list[str],
    num_processes: int = 2,
    devices_per_process: int = 1,
    timeout_s: float | None = 600.0,
    command: str = WORKER_COMMAND,
    capture: bool = True,
    started: list | None = None,
) -> list[subprocess.CompletedProcess]:
    """Runs ``python -m paragan_jax <command> --process-id i --num-processes N --port P
    <worker_args>`` for i in 0..N-1.

    Args:
      worker_args: arguments for every worker.
      num_processes: how many processes (one per device group).
      devices_per_process: simulated CPU devices per process.
      timeout_s: kill the workers after this long (None: no limit).
      command: the internal command each process runs (its module's ``main`` must call
        `initialize`).
      capture: capture the workers' stdout/stderr (else they write to this process's).
      started: if given, the `subprocess.Popen` objects are appended to it as they start (so
        a caller's signal handler can reach them).

    Returns:
      The finished processes (stdout/stderr captured, or None), in process order.

    Raises:
      WorkerFailed: a worker failed or timed out (its output is in the message when captured);
        the others are then killed.
    """
    port = free_port()
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        f"--xla_force_host_platform_device_count={devices_per_process}"
        " --xla_cpu_collective_call_terminate_timeout_seconds=900"
    )
    env["JAX_PLATFORMS"] = "cpu"
    pipe = subprocess.PIPE if capture else None
    procs = started if started is not None else []
    for i in range(num_processes):
        args = [sys.executable, "-m", "paragan_jax", command, "--process-id", str(i)]
        args += ["--num-processes", str(num_processes), "--port", str(port), *worker_args]
        procs.append(subprocess.Popen(args, env=env, stdout=pipe, stderr=pipe, text=True))
    outputs: dict[int, tuple[str | None, str | None]] = {}
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        while len(outputs) < num_processes:
            for i, p in enumerate(procs):
                if i in outputs:
                    continue
                try:
                    outputs[i] = p.communicate(timeout=0.2)
                except subprocess.TimeoutExpired:
                    continue
                if p.returncode != 0:
                    err = outputs[i][1] or ""
                    tail = f":\n{err[-4000:]}" if err else ""
                    raise WorkerFailed(f"worker {i} exited with {p.returncode}{tail}", p.returncode)
            if deadline is not None and time.monotonic() > deadline:
                raise WorkerFailed(f"workers timed out after {timeout_s:.0f} s", 124)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [
        subprocess.CompletedProcess(p.args, p.returncode, *outputs[i]) for i, p in enumerate(procs)
    ]


class ProcessPairRunner:
    """One process of the two-process async scheme, as a runner of `paragan_jax.loop.run_steps`.

    Process 0 is the generator group (its ``run_step`` reads no data), process 1 the
    discriminator group. ``end_step`` is the exchange at the end of each iteration: G's fakes
    and stop decision go to D and, when due, D's params to G's snapshot, so both processes leave
    the loop at the same step (process 0's decision).
    """

    scheme = "async"

    def __init__(self, config: TrainConfig, mesh: Mesh, image_shape: tuple[int, ...]):
        check_batch_divides(config, mesh)
        self.config = config
        self.is_g = jax.process_index() == 0
        self.k = config.async_.staleness
        n_disc, b = config.n_disc, config.data.batch_size
        self._zeros = (
            np.zeros((n_disc, b, *image_shape), np.float32),
            np.zeros((n_disc, b), np.int32),
        )
        self.t = 0  # iterations done
        self.store: CheckpointStore | None = None  # shared by both processes (see end_step)
        if self.is_g:
            self.state, self.side = build_g_side(config, mesh)
            self.side.step = compile_step(self.side.step, self.state, name="g_step")
            fakes, labels = self.side.produce(self.state)
        else:
            self.state, self.side = build_d_side(config, mesh)
            # Compiled here too, so both processes arrive at the first exchange together (gloo
            # gives a peer 30 s to join a collective; one side's compile must not exceed that).
            sh = self.side.batch_sharding
            real = jax.ShapeDtypeStruct((n_disc, b, *image_shape), np.float32, sharding=sh)
            ys = jax.ShapeDtypeStruct((n_disc, b), np.int32, sharding=sh)
            self.side.step = compile_step(
                self.side.step, self.state, {"image": real, "label": ys}, real, ys, name="d_step"
            )
            fakes, labels = self._zeros
        self.fns = self.side.fns
        self._payload = self._zeros
        # Initial exchange: fakes of G_0 to D (the snapshot is the initial D on both sides).
        self.fakes, self.labels, _ = self._exchange(fakes, labels, False, with_snapshot=False)

    @property
    def step(self) -> int:
        return self.t

    def _snapshot_part(self):
        if self.is_g:
            return (self.state["d_snap_params"], self.state["d_snap_stats"])
        return (self.state["d_params"], self.state["d_stats"])

    def _install_snapshot(self, gathered) -> None:
        if self.is_g:
            sh = self.side.shardings
            params = jax.tree.map(lambda x: x[1], gathered[0])
            stats = jax.tree.map(lambda x: x[1], gathered[1])
            self.state["d_snap_params"] = jax.device_put(params, sh["d_snap_params"])
            self.state["d_snap_stats"] = jax.device_put(stats, sh["d_snap_stats"])

    def _exchange(self, fakes, labels, stop: bool, with_snapshot: bool):
        """One all-gather: G's fakes and stop flag to D and, when due, D's params to G."""
        tree = (np.asarray(fakes), np.asarray(labels), np.asarray(stop, np.int32))
        if with_snapshot:
            tree = (*tree, self._snapshot_part())
        got = multihost_utils.process_allgather(tree)
        if with_snapshot:
            self._install_snapshot(got[3])
        return got[0][0], got[1][0], bool(got[2][0])

    def run_step(self, batches: list[dict[str, np.ndarray]]) -> dict[str, jax.Array]:
        if self.is_g:
            if self.k == 0:  # synchronous order: wait for D's update of this iteration
                self._install_snapshot(multihost_utils.process_allgather(self._snapshot_part()))
            self.state, fakes, labels, metrics = self.side.step(self.state)
            self._payload = (fakes, labels)
            return metrics
        sh = self.side.batch_sharding
        batch = device_batch(stack_batches(batches), sh)
        fakes = jax.device_put(np.asarray(self.fakes), sh)
        labels = jax.device_put(np.asarray(self.labels), sh)
        self.state, metrics = self.side.step(self.state, batch, fakes, labels)
        if self.k == 0:
            multihost_utils.process_allgather(self._snapshot_part())
        return metrics

    def end_step(self, stop: bool) -> bool:
        # With k >= 1 the snapshot G uses in iteration t + 1 is D after iteration t's update
        # when (t + 1) % k == 0; it rides on this iteration's fakes exchange.
        snapshot = self.k > 0 and (self.t + 1) % self.k == 0
        self.fakes, self.labels, stop = self._exchange(
            *self._payload, stop and self.is_g, with_snapshot=snapshot
        )
        self.t += 1
        if self.store is not None and (stop or self.store.should_save(self.t)):
            # Both processes reach here after the same exchange: nothing is in flight.
            meta = {"step": self.t, "data_position": self.t * self.config.n_disc}
            self.store.save(self.t, self.checkpoint_tree(), {**meta, "scheme": "async_2proc"})
        return stop

    def _side_tree(self) -> dict[str, Any]:
        if self.is_g:
            return {"state": jax.device_get(self.state)}
        fakes = {"image": np.asarray(self.fakes), "label": np.asarray(self.labels)}
        return {"state": jax.device_get(self.state), "fakes": fakes}

    def checkpoint_tree(self) -> dict[str, np.ndarray]:
        """``{"g": bytes, "d": bytes}`` as uint8 arrays, the same in both processes: each side's
        host tree (`_side_tree`, leaves in tree order, ``np.savez``), all-gathered."""
        buf = io.BytesIO()
        np.savez(buf, *jax.tree.leaves(self._side_tree()))
        mine = np.frombuffer(buf.getvalue(), np.uint8)
        sizes = multihost_utils.process_allgather(np.int32(mine.size))
        padded = np.zeros(int(sizes.max()), np.uint8)
        padded[: mine.size] = mine
        both = multihost_utils.process_allgather(padded)
        return {side: both[i, : int(sizes[i])] for i, side in enumerate(("g", "d"))}

    def load_checkpoint_tree(self, tree: dict[str, np.ndarray], step: int) -> None:
        """Installs this process's side of a restored `checkpoint_tree` of iteration `step`."""
        with np.load(io.BytesIO(tree["g" if self.is_g else "d"].tobytes())) as z:
            leaves = [z[f"arr_{i}"] for i in range(len(z.files))]
        host = jax.tree.unflatten(jax.tree.structure(self._side_tree()), leaves)
        self.state = jax.device_put(host["state"], self.side.shardings)
        if not self.is_g:
            self.fakes, self.labels = host["fakes"]["image"], host["fakes"]["label"]
        self.t = step

    def state_sha256(self) -> dict[str, str]:
        """SHA-256 of each side's host tree (`tree_sha256`), from both processes."""
        digest = np.frombuffer(tree_sha256(self._side_tree()).encode(), np.uint8)
        got = multihost_utils.process_allgather(digest)
        return {"g": bytes(got[0]).decode(), "d": bytes(got[1]).decode()}


def async_worker(args: argparse.Namespace, overrides: list[str]) -> int:
    """One process of the two-process async scheme: G (process 0) or D (process 1).

    Process 0 writes ``result.json`` and ``samples.npy`` into ``args.out``.
    """
    cfg = load_train_config(args.config, overrides)
    mesh = make_mesh("data=-1", jax.local_devices())
    dataset = load_dataset(cfg)
    runner = ProcessPairRunner(cfg, mesh, dataset.images.shape[1:])
    resumed = None
    if args.checkpoint:
        runner.store = CheckpointStore(
            Path(args.out) / "checkpoints", keep=cfg.checkpoint.keep, every=cfg.checkpoint.every
        )
        target = runner.checkpoint_tree()  # the shapes of every checkpoint of this config
        restored = runner.store.restore_latest(target)
        if restored is not None:
            runner.load_checkpoint_tree(restored["state"], restored["step"])
            resumed = restored["step"]
    loader = None
    if not runner.is_g:
        start = runner.t * cfg.n_disc
        loader = PrefetchLoader(
            dataset, cfg.data.batch_size, cfg.data.seed, start, cfg.data.prefetch
        )
    try:
        stats = run_steps(
            runner,
            grouped(loader, cfg.n_disc) if loader is not None else None,
            args.steps - runner.t,
            seconds=args.seconds,
        )
    finally:
        if loader is not None:
            loader.close()
        if runner.store is not None:
            runner.store.close()
    digests = runner.state_sha256()
    if runner.is_g:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        samples = sample_images(
            runner.fns,
            runner.state["ema_params"],
            runner.state["g_stats"],
            jax.random.PRNGKey(1234),
            cfg.eval.num_samples,
        )
        np.save(out / "samples.npy", samples)
        result = {
            "steps": runner.t,
            "steps_run": stats.steps,
            "resumed_from": resumed,
            "state_sha256": digests,
            "timed_steps": stats.timed_steps,
            "wall_s": stats.wall_s,
            "steps_per_sec": stats.steps_per_sec,
            "staleness": runner.k,
            "processes": jax.process_count(),
        }
        (out / "result.json").write_text(json.dumps(result))
    return 0


def run_two_process_async(
    preset: str,
    overrides: list[str],
    out_dir: str,
    seconds: float | None = None,
    steps: int = 10**9,
    devices_per_process: int = 1,
    timeout_s: float = 600.0,
    checkpoint: bool = False,
) -> dict[str, Any]:
    """Trains the async scheme with G in process 0 and D in process 1; returns its results.

    Args:
      steps: total iterations to reach (a resumed run continues from its checkpoint).
      checkpoint: save under ``<out_dir>/checkpoints`` every ``checkpoint.every`` iterations and
        at the end, and resume from there (see the module doc).

    Returns:
      ``result.json`` of process 0 (``steps``: iterations done in total; ``steps_run`` in this
      call; ``resumed_from``; ``state_sha256`` of each side) plus ``samples`` (NumPy array of
      EMA-generator samples).
    """
    args = ["--config", str(preset), "--out", out_dir, "--steps", str(steps)]
    if checkpoint:
        args.append("--checkpoint")
    if seconds is not None:
        args += ["--seconds", str(seconds)]
    launch(args + list(overrides), 2, devices_per_process, timeout_s)
    result = json.loads((Path(out_dir) / "result.json").read_text())
    result["samples"] = np.load(Path(out_dir) / "samples.npy")
    return result


def main(argv: list[str]) -> int:
    """The internal command ``async-worker`` (started by `run_two_process_async`)."""
    p = argparse.ArgumentParser(prog=f"python -m paragan_jax {WORKER_COMMAND}")
    p.add_argument("--process-id", type=int, required=True)
    p.add_argument("--num-processes", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--config", required=True, help="preset name or YAML path")
    p.add_argument("--out", required=True, help="process 0 writes result.json and samples.npy")
    p.add_argument("--steps", type=int, default=10**9)
    p.add_argument("--seconds", type=float)
    p.add_argument("--checkpoint", action="store_true", help="save and resume (see the doc)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    args = p.parse_intermixed_args(argv[1:])
    if args.num_processes != 2:
        raise ValueError(f"{WORKER_COMMAND} needs exactly 2 processes (G and D)")
    initialize(args.process_id, args.num_processes, args.port)
    return async_worker(args, args.overrides)
