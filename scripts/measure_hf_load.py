"""Load time and peak host memory of `serve_jax.hf_checkpoint.load_hf_model` on a local checkpoint.

::

    python scripts/measure_hf_load.py --dir /tmp/hf_llama_400m        # writes it first if absent

writes (once) a random Llama-shaped checkpoint in the Hugging Face layout (config.json, float32
shards of at most ``--shard-mb`` MB and model.safetensors.index.json; about 400 MB by default),
then loads it in a fresh process the way ``serve --model DIR`` does and prints the checkpoint
size, the bytes of the placed weights, the process's resident memory before loading and its peak
(``VmHWM``) after, and the load time. ``--naive`` loads the same files the usual way instead
(every shard into a host dict with ``safetensors.numpy.load_file``, then onto the device), for
comparison.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

SHAPE = dict(
    vocab_size=32000,
    hidden_size=768,
    intermediate_size=2048,
    num_hidden_layers=8,
    num_attention_heads=12,
    num_key_value_heads=4,
    max_position_embeddings=2048,
)


def write_checkpoint(d: Path, shard_mb: int) -> None:
    from safetensors.numpy import save_file

    s = SHAPE
    hd = s["hidden_size"] // s["num_attention_heads"]
    h, kv, f, v = (
        s["hidden_size"],
        s["num_key_value_heads"] * hd,
        s["intermediate_size"],
        s["vocab_size"],
    )
    shapes = {"model.embed_tokens.weight": (v, h)}
    for i in range(s["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (h, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, h),
            p + "mlp.gate_proj.weight": (f, h),
            p + "mlp.up_proj.weight": (f, h),
            p + "mlp.down_proj.weight": (h, f),
        }
    shapes |= {"model.norm.weight": (h,), "lm_head.weight": (v, h)}
    groups, cur, size = [], [], 0
    for name, shape in shapes.items():
        nbytes = 4 * int(np.prod(shape))
        if cur and size + nbytes > shard_mb * 2**20:
            groups.append(cur)
            cur, size = [], 0
        cur.append(name)
        size += nbytes
    groups.append(cur)
    d.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    weight_map = {}
    for i, names in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {n: rng.standard_normal(shapes[n], np.float32) * 0.02 for n in names}
        save_file(tensors, str(d / fname))
        weight_map |= dict.fromkeys(names, fname)
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **SHAPE}
    cfg |= {"rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False}
    (d / "config.json").write_text(json.dumps(cfg, indent=2))


def _rss(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def measure(d: Path, naive: bool) -> dict:
    import jax
    from flax import nnx

    from serve_jax.hf_checkpoint import checkpoint_files, load_hf_model
    from serve_jax.hf_config import hf_model_config

    jax.devices()
    base = _rss("VmRSS")
    t0 = time.perf_counter()
    cfg = hf_model_config(d, dtype="float32")
    if naive:
        from safetensors.numpy import load_file

        host = {}
        for f in checkpoint_files(d):
            host |= load_file(str(f))
        placed = [
            jax.device_put(np.ascontiguousarray(a.T if a.ndim == 2 else a)) for a in host.values()
        ]
        leaves = placed
    else:
        model = load_hf_model(d, cfg)
        leaves = jax.tree.leaves(nnx.state(model))
    jax.block_until_ready(leaves)
    seconds = time.perf_counter() - t0
    return {
        "mode": "naive (load_file, then device_put)" if naive else "load_hf_model",
        "checkpoint_bytes": sum(f.stat().st_size for f in d.glob("*.safetensors")),
        "weights_bytes": sum(x.nbytes for x in leaves),
        "rss_before_bytes": base,
        "peak_rss_bytes": _rss("VmHWM"),
        "load_seconds": seconds,
        "backend": jax.default_backend(),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default="/tmp/hf_llama_400m")
    p.add_argument("--shard-mb", type=int, default=100)
    p.add_argument("--naive", action="store_true", help="the usual whole-dict load, to compare")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    d = Path(args.dir)
    if args.child:
        print(json.dumps(measure(d, args.naive)))
        return
    if not (d / "config.json").is_file():
        print(f"writing a random checkpoint to {d} ...", flush=True)
        write_checkpoint(d, args.shard_mb)
    cmd = [sys.executable, __file__, "--dir", str(d), "--child"] + (
        ["--naive"] if args.naive else []
    )
    r = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    mb = 2**20
    print(
        f"{r['mode']} on {r['backend']}: checkpoint {r['checkpoint_bytes'] / mb:.0f} MiB, "
        f"weights placed {r['weights_bytes'] / mb:.0f} MiB, load {r['load_seconds']:.2f} s"
    )
    print(
        f"RSS before {r['rss_before_bytes'] / mb:.0f} MiB, "
        f"peak {r['peak_rss_bytes'] / mb:.0f} MiB: "
        f"peak - before = {(r['peak_rss_bytes'] - r['rss_before_bytes']) / mb:.0f} MiB = "
        f"{(r['peak_rss_bytes'] - r['rss_before_bytes']) / r['checkpoint_bytes']:.2f} x checkpoint"
    )


if __name__ == "__main__":
    main()
