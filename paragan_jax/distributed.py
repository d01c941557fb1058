"""Multi-process launcher and the two-process asynchronous scheme (one process per group).

`launch` starts N local processes of ``python -m paragan_jax.distributed`` that join one JAX
runtime with `jax.distributed.initialize` (coordinator on 127.0.0.1, gloo CPU collectives), the
way hosts of a TPU pod do; `initialize` is the part each process runs (reusable by other tools).

The async worker runs `paragan_jax.async_scheme`'s schedule with process 0 as the generator group
and process 1 as the discriminator group, each data parallel over its own local devices:

- fake batches go G -> D and D snapshots go D -> G through
  `jax.experimental.multihost_utils.process_allgather` (a gloo all-gather across the processes;
  both processes call the exchanges in the same order, fixed by the schedule);
- per iteration: [every k iterations: D sends its params, G installs them as its snapshot];
  both groups dispatch their step (G: update against the snapshot, then fakes of the new G; D:
  update on a real batch and the fakes received in the previous exchange); then the fakes (and a
  stop flag decided by process 0's time budget) are exchanged. D's step runs while process 1
  waits in that exchange for G's fakes, so the two steps overlap in wall-clock time;
- ``k = 0`` runs D's step, sends the updated D, then G's step: the synchronous schedule.

Process 0 writes ``result.json`` (steps, steps/s) and ``samples.npy`` (EMA generator) into the
output directory; `run_two_process_async` launches the pair and reads them back.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["free_port", "initialize", "launch", "run_two_process_async"]


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def initialize(process_id: int, num_processes: int, port: int) -> None:
    """Joins this process to a local multi-process JAX runtime with gloo CPU collectives."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=num_processes,
        process_id=process_id,
    )


def launch(
    worker_args: list[str],
    num_processes: int = 2,
    devices_per_process: int = 1,
    timeout_s: float = 600.0,
    module: str = "paragan_jax.distributed",
) -> list[subprocess.CompletedProcess]:
    """Runs ``python -m <module> --process-id i --num-processes N --port P <worker_args>``.

    Args:
      worker_args: arguments for every worker.
      num_processes: how many processes (one per device group).
      devices_per_process: simulated CPU devices per process.
      timeout_s: kill the workers after this long.
      module: the worker module (its ``__main__`` must call `initialize`).

    Returns:
      The finished processes (stdout/stderr captured), in process order.

    Raises:
      RuntimeError: a worker failed or timed out; its output is in the message.
    """
    port = free_port()
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        f"--xla_force_host_platform_device_count={devices_per_process}"
        " --xla_cpu_collective_call_terminate_timeout_seconds=900"
    )
    env["JAX_PLATFORMS"] = "cpu"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                module,
                "--process-id",
                str(i),
                "--num-processes",
                str(num_processes),
                "--port",
                str(port),
                *worker_args,
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(num_processes)
    ]
    results = []
    deadline = time.monotonic() + timeout_s
    try:
        for i, p in enumerate(procs):
            try:
                out, err = p.communicate(timeout=max(deadline - time.monotonic(), 1.0))
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"worker {i} timed out after {timeout_s:.0f} s") from None
            results.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
            if p.returncode != 0:
                raise RuntimeError(f"worker {i} exited with {p.returncode}:\n{err[-4000:]}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return results


def _async_worker(args: argparse.Namespace, overrides: list[str]) -> int:
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    from tapas_jax.mesh import make_mesh

    from .async_scheme import build_d_side, build_g_side
    from .config import load_train_config
    from .data import PrefetchLoader, load_dataset
    from .train import check_batch_divides, compile_step, sample_images, stack_batches

    cfg = load_train_config(args.config, overrides)
    pid = jax.process_index()
    is_g = pid == 0
    mesh = make_mesh("data=-1", jax.local_devices())
    check_batch_divides(cfg, mesh)
    k, n_disc, b = cfg.async_.staleness, cfg.n_disc, cfg.data.batch_size
    dataset = load_dataset(cfg)
    img_shape = (n_disc, b) + dataset.images.shape[1:]

    if is_g:
        state, side = build_g_side(cfg, mesh)
        side.step = compile_step(side.step, state, name="g_step")
        fakes, labels = side.produce(state)
    else:
        state, side = build_d_side(cfg, mesh)
        loader = PrefetchLoader(dataset, b, cfg.data.seed, 0, cfg.data.prefetch)
        fakes = np.zeros(img_shape, np.float32)
        labels = np.zeros((n_disc, b), np.int32)

    def snapshot_part():
        if is_g:
            return (state["d_snap_params"], state["d_snap_stats"])
        return (state["d_params"], state["d_stats"])

    def install_snapshot(gathered):
        if is_g:
            params = jax.tree.map(lambda x: x[1], gathered[0])
            stats = jax.tree.map(lambda x: x[1], gathered[1])
            state["d_snap_params"] = jax.device_put(params, side.shardings["d_snap_params"])
            state["d_snap_stats"] = jax.device_put(stats, side.shardings["d_snap_stats"])

    def exchange(fakes, labels, flag, with_snapshot: bool):
        """One all-gather: G's fakes and stop flag to D and, when due, D's params to G."""
        tree = (np.asarray(fakes), np.asarray(labels), np.asarray(flag, np.int32))
        if with_snapshot:
            tree = (*tree, snapshot_part())
        got = multihost_utils.process_allgather(tree)
        if with_snapshot:
            install_snapshot(got[3])
        return got[0][0], got[1][0], bool(got[2][0])

    # Initial exchange: fakes of G_0 to D (the snapshot is the initial D on both sides).
    fakes, labels, _ = exchange(fakes, labels, 0, False)
    stop, t, t0 = False, 0, None
    steps_timed = 0
    zeros = (np.zeros(img_shape, np.float32), np.zeros((n_disc, b), np.int32))
    while not stop:
        if is_g:
            if k == 0:  # synchronous order: wait for D's update of this iteration
                install_snapshot(multihost_utils.process_allgather(snapshot_part()))
            state, new_fakes, new_labels, _ = side.step(state)
            elapsed = 0.0 if t0 is None else time.perf_counter() - t0
            flag = t + 1 >= args.steps or (args.seconds is not None and elapsed >= args.seconds)
            payload = (new_fakes, new_labels, flag)
        else:
            batch = jax.device_put(
                stack_batches([next(loader) for _ in range(n_disc)]), side.batch_sharding
            )
            f = jax.device_put(np.asarray(fakes), side.batch_sharding)
            lab = jax.device_put(np.asarray(labels), side.batch_sharding)
            state, _ = side.step(state, batch, f, lab)
            if k == 0:
                multihost_utils.process_allgather(snapshot_part())
            payload = (*zeros, False)
        # With k >= 1 the snapshot G uses in iteration t + 1 is D after iteration t's update
        # when (t + 1) % k == 0; it rides on this iteration's fakes exchange.
        fakes, labels, stop = exchange(*payload, with_snapshot=k > 0 and (t + 1) % k == 0)
        t += 1
        if t0 is None:  # the first iteration compiled both programs
            jax.block_until_ready(state)
            t0 = time.perf_counter()
        else:
            steps_timed += 1
    jax.block_until_ready(state)
    wall = time.perf_counter() - t0
    if not is_g:
        loader.close()
    if is_g:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        samples = sample_images(
            side.fns,
            state["ema_params"],
            state["g_stats"],
            jax.random.PRNGKey(1234),
            cfg.eval.num_samples,
        )
        np.save(out / "samples.npy", samples)
        (out / "result.json").write_text(
            json.dumps(
                {
                    "steps": t,
                    "timed_steps": steps_timed,
                    "wall_s": wall,
                    "steps_per_sec": steps_timed / wall if wall > 0 else float("nan"),
                    "staleness": k,
                    "processes": jax.process_count(),
                }
            )
        )
    return 0


def run_two_process_async(
    preset: str,
    overrides: list[str],
    out_dir: str,
    seconds: float | None = None,
    steps: int = 10**9,
    devices_per_process: int = 1,
    timeout_s: float = 600.0,
) -> dict[str, Any]:
    """Trains the async scheme with G in process 0 and D in process 1; returns its results.

    Returns:
      ``result.json`` of process 0 plus ``samples`` (NumPy array of EMA-generator samples).
    """
    import numpy as np

    args = ["async-train", "--config", str(preset), "--out", out_dir, "--steps", str(steps)]
    if seconds is not None:
        args += ["--seconds", str(seconds)]
    launch(args + list(overrides), 2, devices_per_process, timeout_s)
    result = json.loads((Path(out_dir) / "result.json").read_text())
    result["samples"] = np.load(Path(out_dir) / "samples.npy")
    return result


def _main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m paragan_jax.distributed")
    p.add_argument("--process-id", type=int, required=True)
    p.add_argument("--num-processes", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("role", choices=["async-train"])
    p.add_argument("--config", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=10**9)
    p.add_argument("--seconds", type=float)
    args, overrides = p.parse_known_args(argv)
    if args.num_processes != 2:
        print("async-train needs exactly 2 processes (G and D)", file=sys.stderr)
        return 2
    initialize(args.process_id, args.num_processes, args.port)
    return _async_worker(args, overrides)


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
