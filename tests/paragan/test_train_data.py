"""The Trainer's data per process (`paragan_jax.train_data`): each process reads only its shards
and feeds its share of the global batch; the global batch is a pure function of the position
(two real processes agree with one process computing it); resume lands on the same position; the
metrics' reference sample."""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from paragan_jax.config import load_train_config
from paragan_jax.data import DataError, batch_at, load_dataset
from paragan_jax.distributed import free_port
from paragan_jax.pipeline import trainer_batch_iterator_factory
from paragan_jax.pipeline_control import PipelineConfig
from paragan_jax.shards import write_shards
from paragan_jax.train_data import process_seed, reference_dataset

PER_SHARD = 10


def _write(path, n: int) -> np.ndarray:
    """`n` random 8x8 grey images in shards of 10; the label of an example is its index."""
    images = np.random.default_rng(0).integers(0, 256, (n, 8, 8, 1), dtype=np.uint8)
    labels = np.arange(n, dtype=np.int32)
    chunks = [(images[i : i + 40], labels[i : i + 40]) for i in range(0, n, 40)]
    write_shards(str(path), chunks, n, (8, 8, 1), examples_per_shard=PER_SHARD)
    return images


def _config(path, *extra):
    over = ["data.source=shards", f"data.path={path}", "model.num_classes=0", "data.seed=3"]
    return load_train_config("tiny", [*over, *extra])


def _global_batch_at(config, process_count: int, index: int):
    """Global batch `index` of a per-process shards run of `process_count` processes, computed
    in one process (each process's part from its own shards, in process order: the rows of a
    data axis laid out process by process, as ``jax.devices()`` orders them)."""
    d = config.data
    parts = []
    for p in range(process_count):
        dataset = load_dataset(config, p, process_count)
        seed = process_seed(d.seed, p, process_count)
        parts.append(batch_at(dataset, d.batch_size // process_count, seed, index))
    return {k: np.concatenate([b[k] for b in parts]) for k in parts[0]}


def _own(ids, process: int, count: int) -> bool:
    return all((i // PER_SHARD) % count == process for i in np.ravel(ids))


def test_each_process_batch_comes_from_its_shards_and_they_make_the_global_batch(tmp_path):
    images = _write(tmp_path, 103)  # 11 shards: process 0 holds 6 (53 examples), process 1 5
    cfg = _config(tmp_path)  # batch 16: 8 a process, 6 batches an epoch each
    parts = [load_dataset(cfg, p, 2) for p in range(2)]
    assert [len(d) for d in parts] == [53, 50] and [d.epoch_size for d in parts] == [50, 50]
    seeds = [process_seed(3, p, 2) for p in range(2)]
    assert process_seed(3, 0, 1) == 3 and len(set(seeds)) == 2
    for p, d in enumerate(parts):
        epoch = [batch_at(d, 8, seeds[p], i)["label"] for i in range(6)]
        assert _own(epoch, p, 2) and len(np.unique(epoch)) == 48  # no example twice an epoch
        assert not np.array_equal(batch_at(d, 8, seeds[p], 6)["label"], epoch[0])  # new order
    # The global batch: process 0's rows then process 1's, each from its own shards (so the
    # halves are disjoint), the written examples (the label is the index); an epoch of global
    # batches uses each of its 96 examples once, and the next epoch draws a new order.
    epoch = []
    for i in range(7):
        glob = _global_batch_at(cfg, 2, i)
        assert _own(glob["label"][:8], 0, 2) and _own(glob["label"][8:], 1, 2)
        np.testing.assert_array_equal(glob["image"], images[glob["label"]])
        epoch.append(glob["label"])
    assert len(np.unique(epoch[:6])) == 96
    assert not np.array_equal(epoch[6], epoch[0])
    # One process reads what it always did: every shard, the written examples in order.
    whole = load_dataset(cfg)
    assert len(whole) == whole.epoch_size == 103
    np.testing.assert_array_equal(whole.labels, np.arange(103))
    np.testing.assert_array_equal(whole.images, images)
    with pytest.raises(
        DataError, match=r"process 1 serves 50 .* share of data.batch_size=128 \(64\)"
    ):
        load_dataset(_config(tmp_path, "data.batch_size=128"), 1, 2)


def test_the_adaptive_pipeline_serves_a_process_the_same_batches(tmp_path):
    _write(tmp_path, 103)
    local = load_dataset(_config(tmp_path), 1, 2)
    factory = trainer_batch_iterator_factory(PipelineConfig(num_workers=2))
    seed = process_seed(3, 1, 2)
    stream = factory(local, 8, seed, 4)  # crosses the epoch boundary at batch 6
    try:
        for i in range(4, 9):
            np.testing.assert_array_equal(
                next(stream)["label"], batch_at(local, 8, seed, i)["label"]
            )
    finally:
        stream.close()


def test_the_metrics_reference_is_a_fixed_sample_of_the_whole_set(tmp_path):
    images = _write(tmp_path, 103)
    cfg = _config(tmp_path, "eval.reference_size=40")
    local = load_dataset(cfg, 1, 2)
    ref = reference_dataset(cfg, local)
    ids = ref.labels
    assert len(ref) == 40 and np.all(np.diff(ids) > 0) and not _own(ids, 1, 2)  # both shares
    np.testing.assert_array_equal(ref.images, images[ids])
    whole = reference_dataset(_config(tmp_path), local)  # smaller than the sample: all of it
    np.testing.assert_array_equal(whole.labels, np.arange(103))
    np.testing.assert_array_equal(whole.images, images)
    digits = load_train_config("tiny")
    in_memory = load_dataset(digits)
    assert reference_dataset(digits, in_memory) is in_memory


_WORKER = textwrap.dedent(
    """
    import json, sys
    from jax.experimental import multihost_utils
    from paragan_jax.config import load_train_config
    from paragan_jax.data import PrefetchLoader, batch_at
    from paragan_jax.distributed import initialize
    from paragan_jax.train import Trainer

    pid, count, port, work, steps, out = sys.argv[1:7]
    initialize(int(pid), int(count), int(port))
    cfg = load_train_config("tiny", json.loads(sys.argv[7]))
    seen = {"starts": [], "labels": []}

    def recording(dataset, batch_size, seed, start):  # the default loader, recorded
        seen["starts"].append(start)
        seen.update(local_len=len(dataset), batch_size=batch_size)
        for batch in PrefetchLoader(dataset, batch_size, seed, start, 2):
            seen["labels"].append(batch["label"].tolist())
            yield batch

    t = Trainer(cfg, work, batch_iterator_factory=recording, progress=False)
    summary = t.train(steps=int(steps))
    d = t.data  # global batch 5 as the Trainer's runner places it, gathered
    placed = t.runner.put_batch([batch_at(d.dataset, d.batch_size, d.seed, 5)])
    glob = multihost_utils.process_allgather(placed["label"], tiled=True)
    seen.update(
        step=summary["step"],
        resumed_from=summary["resumed_from"],
        sha=t.state_sha256(),
        global5=glob.tolist(),
    )
    with open(f"{out}.{pid}", "w") as f:
        json.dump(seen, f)
    """
)


def _two_processes(tmp_path, work, steps: int, overrides: list[str]) -> list[dict]:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    port, out = free_port(), tmp_path / f"{work.name}-{steps}.json"
    cmd = [sys.executable, "-c", _WORKER]
    args = [str(port), str(work), str(steps), str(out), json.dumps(overrides)]
    procs = [
        subprocess.Popen([*cmd, str(p), "2", *args], env=env, stderr=subprocess.PIPE, text=True)
        for p in range(2)
    ]
    for p in procs:
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
    return [json.loads((tmp_path / f"{out.name}.{p}").read_text()) for p in range(2)]


@pytest.mark.slow
def test_two_processes_read_their_shards_and_resume_at_the_same_position(tmp_path):
    _write(tmp_path / "data", 103)
    over = ["data.source=shards", f"data.path={tmp_path / 'data'}", "model.num_classes=0"]
    over += ["data.seed=3", "sharding.num_devices=0", "checkpoint.every=3", "eval.log_every=100"]
    straight = _two_processes(tmp_path, tmp_path / "straight", 6, over)
    _two_processes(tmp_path, tmp_path / "part", 3, over)
    resumed = _two_processes(tmp_path, tmp_path / "part", 6, over)
    want = _global_batch_at(_config(tmp_path / "data"), 2, 5)["label"]
    for p in range(2):
        s, r = straight[p], resumed[p]
        assert (s["local_len"], s["batch_size"]) == ([53, 50][p], 8)  # its shards, its share
        assert len(s["labels"]) == 6 and _own(s["labels"], p, 2)  # 6 batches, own shards only
        assert s["starts"] == [0] and r["starts"] == [3] and r["resumed_from"] == 3
        assert r["labels"] == s["labels"][3:]  # the same data position
        assert s["global5"] == [want.tolist()] == r["global5"]  # one process's computation
        assert r["step"] == 6 and r["sha"] == s["sha"] == straight[0]["sha"]
