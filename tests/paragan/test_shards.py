"""Sharded uint8 data sets: prepare, per-process reads (local and HTTP), resume, bounded memory."""

import dataclasses
import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from paragan_jax.data import DataError
from paragan_jax.http_store import CongestionModel, ObjectServer
from paragan_jax.pipeline import InputPipeline
from paragan_jax.pipeline_control import PipelineConfig
from paragan_jax.prepare import PrepareCommand, prepare
from paragan_jax.shards import ShardedStorage, read_manifest, write_shards


def _random(n, hw=6, c=3, seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (n, hw, hw, c), dtype=np.uint8), np.arange(n, dtype=np.int32)


def _write(path, n, per_shard, hw=6):
    images, labels = _random(n, hw)
    chunks = [(images[i : i + 50], labels[i : i + 50]) for i in range(0, n, 50)]
    write_shards(str(path), chunks, n, (hw, hw, 3), examples_per_shard=per_shard)
    return images


@pytest.mark.parametrize("count", [1, 2, 3])
def test_each_process_reads_only_its_shards_and_together_they_cover(tmp_path, count):
    images = _write(tmp_path, 103, per_shard=16)  # 7 shards, the last one short
    seen = []
    sizes = [len(ShardedStorage(str(tmp_path), q, count)) for q in range(count)]
    for p in range(count):
        st = ShardedStorage(str(tmp_path), p, count)
        assert st.epoch_size == min(sizes)
        got = [st.fetch(i) for i in range(len(st))]
        for ex in got:
            np.testing.assert_array_equal(ex["image"], images[ex["label"]])
            assert ex["image"].dtype == np.uint8
        own = {int(ex["label"]) // 16 for ex in got}  # shard of each example
        batch = st.read(np.array([2, 0, 1]))
        np.testing.assert_array_equal(batch["image"], images[batch["label"]])
        assert batch["label"].tolist() == [int(got[k]["label"]) for k in (2, 0, 1)]
        assert own == set(range(p, 7, count))
        seen += [int(ex["label"]) for ex in got]
    assert sorted(seen) == list(range(103))


def test_http_reads_go_through_sockets_to_own_shards_only(tmp_path):
    images = _write(tmp_path, 64, per_shard=16)
    clean = CongestionModel(base_latency_s=0.0005, bandwidth_bytes_per_s=50e6)
    with ObjectServer(tmp_path, clean, congested=False) as srv:
        st = ShardedStorage(srv.url, process_index=1, process_count=2)
        before = srv.counters["requests"]
        for i in range(len(st)):
            ex = st.fetch(i)
            np.testing.assert_array_equal(ex["image"], images[ex["label"]])
        per_example = (srv.counters["requests"] - before) / len(st)
        dirs = srv.top_dirs_requested - {"manifest.json"}
    assert dirs == {"shard-00001", "shard-00003"}
    assert per_example <= 1.1  # one range read an example (shard indices are cached)


def test_pipeline_over_shards_is_deterministic_and_resumes_exactly(tmp_path):
    _write(tmp_path, 100, per_shard=20)
    st = ShardedStorage(str(tmp_path), 0, 2)  # shards 0, 2, 4: 60 examples, epoch_size 40
    cfg = PipelineConfig(batch_size=8, num_workers=3, drop_remainder=True, seed=4)

    def run(epoch, batch, n):
        pipe = InputPipeline(st, cfg, process_index=0, process_count=1, epoch_size=st.epoch_size)
        with pipe.batches(epoch, batch) as it:
            return [next(it)["label"].tolist() for _ in range(n)]

    full = run(0, 0, 12)  # 5 batches an epoch: crosses two epoch boundaries
    assert full == run(0, 0, 12)
    assert run(1, 2, 5) == full[7:]
    first = [x for b in full[:5] for x in b]
    assert len(set(first)) == 40 and set(first) <= set(st.labels.tolist())
    assert full[:5] != full[5:10]  # a fresh permutation each epoch


def _bilinear(img: np.ndarray, size: int) -> np.ndarray:
    """By hand: bilinear resize with half-pixel centres and clamped edges, rounded to uint8."""
    h, w, _ = img.shape

    def taps(n_in):
        x = np.clip((np.arange(size) + 0.5) * n_in / size - 0.5, 0, n_in - 1)
        lo = np.floor(x).astype(int)
        return lo, np.minimum(lo + 1, n_in - 1), x - lo

    (y0, y1, wy), (x0, x1, wx) = taps(h), taps(w)
    f = img.astype(np.float64)
    rows = f[y0] * (1 - wy)[:, None, None] + f[y1] * wy[:, None, None]
    out = rows[:, x0] * (1 - wx)[None, :, None] + rows[:, x1] * wx[None, :, None]
    return np.clip(np.rint(out), 0, 255).astype(np.uint8)


def test_prepare_folder_and_npy(tmp_path):
    from PIL import Image

    rng = np.random.default_rng(1)
    originals = {}
    for cls in ("cat", "dog"):
        (tmp_path / "imgs" / cls).mkdir(parents=True)
        for k in range(3):
            arr = rng.integers(0, 256, (10, 10, 3), dtype=np.uint8)
            Image.fromarray(arr).save(tmp_path / "imgs" / cls / f"{k}.png")
            originals[(cls, k)] = arr
    m = prepare(PrepareCommand(src=str(tmp_path / "imgs"), out=str(tmp_path / "a"), resolution=8))
    assert (m["count"], m["image_shape"], m["num_classes"]) == (6, [8, 8, 3], 2)
    assert m["class_names"] == ["cat", "dog"] and read_manifest(str(tmp_path / "a")) == m
    st = ShardedStorage(str(tmp_path / "a"))
    assert st.labels.tolist() == [0, 0, 0, 1, 1, 1]
    dog = originals[("dog", 2)]
    np.testing.assert_array_equal(st.fetch(5)["image"], _bilinear(dog, 8))
    grey = prepare(
        PrepareCommand(
            src=str(tmp_path / "imgs"), out=str(tmp_path / "g"), resolution=8, channels=1
        )
    )
    assert grey["image_shape"] == [8, 8, 1]
    luma = np.rint(dog.astype(np.float64).mean(axis=-1, keepdims=True))  # channels, then size
    np.testing.assert_array_equal(
        ShardedStorage(str(tmp_path / "g")).fetch(5)["image"], _bilinear(luma, 8)
    )

    (tmp_path / "npy").mkdir()
    floats = rng.uniform(-1, 1, (5, 4, 4)).astype(np.float32)
    np.savez(tmp_path / "npy" / "a.npz", images=floats, labels=np.array([0, 1, 2, 3, 4]))
    m = prepare(PrepareCommand(src=str(tmp_path / "npy"), out=str(tmp_path / "b"), channels=3))
    assert (m["count"], m["image_shape"], m["num_classes"]) == (5, [4, 4, 3], 5)
    img = ShardedStorage(str(tmp_path / "b")).fetch(3)["image"]
    want = np.rint((floats[3] + 1) * 127.5).astype(np.uint8)
    for c in range(3):  # grey repeated to RGB
        np.testing.assert_array_equal(img[..., c], want)


def test_prepare_errors_name_the_problem(tmp_path):
    from PIL import Image

    (tmp_path / "mixed").mkdir()
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(tmp_path / "mixed" / "a.png")
    Image.fromarray(np.zeros((9, 9, 3), np.uint8)).save(tmp_path / "mixed" / "b.png")
    with pytest.raises(DataError, match="mixed sizes"):
        prepare(PrepareCommand(src=str(tmp_path / "mixed"), out=str(tmp_path / "o")))
    with pytest.raises(FileNotFoundError, match="neither"):
        prepare(PrepareCommand(src=str(tmp_path / "none"), out=str(tmp_path / "o")))
    with pytest.raises(FileNotFoundError, match="manifest.json"):
        ShardedStorage(str(tmp_path / "mixed"))
    _write(tmp_path / "two", 20, per_shard=10)
    with pytest.raises(ValueError, match="2 shards for 3 processes"):
        ShardedStorage(str(tmp_path / "two"), 0, 3)


_READER = textwrap.dedent(
    """
    import json, sys
    from paragan_jax.pipeline import InputPipeline
    from paragan_jax.pipeline_control import PipelineConfig
    from paragan_jax.shards import ShardedStorage

    st = ShardedStorage(sys.argv[1])
    cfg = PipelineConfig(batch_size=32, num_workers=8, prefetch_depth=4, adaptive=False,
                         drop_remainder=True,
                         memory_cap_bytes=8 * 2**20)
    n = 0
    with InputPipeline(st, cfg, 0, 1).batches() as it:  # the same number of steps from each
        for _ in range(int(sys.argv[2])):
            n += len(next(it)["label"])
    # VmHWM: this process's peak RSS (ru_maxrss would carry the parent's over exec)
    hwm = next(l for l in open("/proc/self/status") if l.startswith("VmHWM"))
    print(json.dumps({"examples": n, "peak_rss_kb": int(hwm.split()[1])}))
    """
)


def _peak_rss_reading(path, batches: int) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", _READER, str(path), str(batches)],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_host_memory_stays_flat_on_a_ten_times_larger_data_set(tmp_path):
    hw, per = 128, 250  # 48 KiB an image: 12 MiB against 120 MiB
    for name, n in (("small", 250), ("large", 2500)):
        rng = np.random.default_rng(0)
        chunks = (
            (rng.integers(0, 256, (per, hw, hw, 3), dtype=np.uint8), np.zeros(per, np.int32))
            for _ in range(n // per)
        )
        write_shards(str(tmp_path / name), chunks, n, (hw, hw, 3), examples_per_shard=per)
    # A training run reads a number of steps, whatever the data set's size: 78 batches of 32
    # are ten epochs of the small set and one of the large.
    small = _peak_rss_reading(tmp_path / "small", 78)
    large = _peak_rss_reading(tmp_path / "large", 78)
    assert small["examples"] == large["examples"] == 78 * 32
    assert large["peak_rss_kb"] <= 1.2 * small["peak_rss_kb"], (small, large)


def test_uint8_batches_are_cast_on_the_device_like_on_the_host():
    import jax

    from paragan_jax.data import as_float_images, device_batch

    images = _random(16, hw=4)[0]
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    out = device_batch({"image": images, "label": np.zeros(16, np.int32)}, sharding)
    assert out["image"].dtype == np.float32
    np.testing.assert_array_equal(np.asarray(out["image"]), as_float_images(images))
    every = as_float_images(np.arange(256, dtype=np.uint8))
    assert every[0] == -1.0 and every[-1] == 1.0 and np.all(np.diff(every) > 0)


def test_trainer_on_shards_reads_the_batches_of_the_same_data_in_memory(tmp_path):
    from paragan_jax.config import load_train_config
    from paragan_jax.data import batch_at, load_dataset
    from paragan_jax.shards import ShardImages

    m = prepare(PrepareCommand(src="digits", out=str(tmp_path / "sh"), resolution=8))
    st = ShardedStorage(str(tmp_path / "sh"))
    everything = st.read(np.arange(len(st)))
    (tmp_path / "npy").mkdir()
    np.savez(tmp_path / "npy" / "d.npz", images=everything["image"], labels=everything["label"])
    cfgs, sets = {}, {}
    for source, path in (("shards", tmp_path / "sh"), ("npy", tmp_path / "npy")):
        cfgs[source] = load_train_config("tiny", [f"data.source={source}", f"data.path={path}"])
        sets[source] = load_dataset(cfgs[source])
        assert sets[source].images.dtype == np.uint8 and len(sets[source]) == m["count"] == 1797
    assert isinstance(sets["shards"].images, ShardImages)
    lazy, dense = sets["shards"].images, sets["npy"].images
    mask = np.zeros(len(dense), bool)
    mask[[3, 500, 1796]] = True
    for index in (5, -1, slice(10, 40, 7), slice(None, None, -300), [4, -2, 4], mask, []):
        np.testing.assert_array_equal(lazy[index], dense[index])  # NumPy's indexing meaning
    for bad in (1797, [0, -1798], mask[:-1], [0.5]):
        with pytest.raises(IndexError):
            lazy[bad]
    for i in (0, 111, 112):  # 112 batches of 16 an epoch
        a, b = batch_at(sets["shards"], 16, 3, i), batch_at(sets["npy"], 16, 3, i)
        np.testing.assert_array_equal(a["image"], b["image"])
        np.testing.assert_array_equal(a["label"], b["label"])
    wrong = dataclasses.replace(
        cfgs["shards"], model=dataclasses.replace(cfgs["shards"].model, resolution=16)
    )
    with pytest.raises(DataError, match="prepare with --resolution 16"):
        load_dataset(wrong)


@pytest.mark.slow
def test_trainer_trains_on_shards_with_uint8_batches(tmp_path):
    from paragan_jax.config import load_train_config
    from paragan_jax.train import Trainer

    prepare(PrepareCommand(src="digits", out=str(tmp_path / "sh"), resolution=8))
    cfg = load_train_config("tiny", ["data.source=shards", f"data.path={tmp_path / 'sh'}"])
    summary = Trainer(cfg, str(tmp_path / "run"), progress=False).train(steps=2)
    assert summary["step"] == 2 and all(np.isfinite(v) for v in summary["metrics"].values())


def test_channel_conversion_of_uint8_and_float_images():
    from paragan_jax.data import convert_channels

    rgb = np.array([[[[10, 11, 13], [0, 0, 1]]]], np.uint8)  # (1, 1, 2, 3)
    assert convert_channels(rgb, 1).tolist() == [[[[11], [0]]]]  # 34/3 and 1/3, rounded
    assert convert_channels(rgb, 1).dtype == np.uint8 and convert_channels(rgb, 3) is rgb
    floats = rgb.astype(np.float32) / 255
    np.testing.assert_allclose(convert_channels(floats, 1)[..., 0], floats.mean(axis=-1))
    grey = rgb[..., :1]
    assert convert_channels(grey, 3).tolist() == [[[[10, 10, 10], [0, 0, 0]]]]
    with pytest.raises(DataError, match="npy:x: images have 2 channels; cannot make 3"):
        convert_channels(rgb[..., :2], 3, "npy:x")
