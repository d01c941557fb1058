"""The peer baseline: Hugging Face transformers ``generate`` at a serve_jax preset's shape, and
the side-by-side comparison with our Engine in one run.

Builds a randomly initialised ``LlamaForCausalLM`` with the shapes of a serve_jax model preset
(``--preset``, read from the jax-free `serve_jax.model_config`: ``small`` is d_model 512, 8
layers, vocab 512, 24.1M parameters; ``smollm-135m`` is SmolLM-135M's real shape, 30 layers,
vocab 49152, tied embeddings, 134.5M parameters; float32) and times greedy ``generate`` on a
batch of random prompts exactly as ``python -m serve_jax bench --micro generate`` times our
Engine: decode tok/s = batch x new_tokens / (t(new_tokens + 1) - t(1)).

With ``--serve-python PY`` it also runs that Engine benchmark (``PY -m serve_jax bench --micro
generate``, same preset, batch, context and new tokens) in alternating pairs, HF then ours,
``--pairs`` times, and prints the table of both with the ratio: one run, same machine, same
timing, machine noise spread over both.

Needs ``torch`` and ``transformers``, which are not dependencies of this project:

    python -m venv /tmp/hf && /tmp/hf/bin/pip install torch transformers
    /tmp/hf/bin/python scripts/hf_generate_baseline.py --preset smollm-135m \\
        --batch 16 --context 256 --new-tokens 64 --pairs 3 --serve-python .venv/bin/python

Writes JSON (``--json``) with the keys of our benchmark (and the pairs, when run side by side).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _model_config(preset: str):
    """The preset's `ModelConfig` from serve_jax's jax-free registry (no jax needed here)."""
    sys.path.insert(0, str(ROOT))
    from serve_jax.model_config import get_model_config

    return get_model_config(preset)


def build_hf_model(preset: str):
    """A random ``LlamaForCausalLM`` with the preset's shapes (float32, eval mode)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    mc = _model_config(preset)
    if mc.rope_scaling is not None or mc.qkv_bias:
        raise ValueError(f"{preset}: rope_scaling / qkv_bias shapes are not mirrored here")
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=mc.vocab_size,
        hidden_size=mc.d_model,
        intermediate_size=mc.ffn_dim,
        num_hidden_layers=mc.n_layers,
        num_attention_heads=mc.n_heads,
        num_key_value_heads=mc.n_kv_heads,
        head_dim=mc.head_dim,
        max_position_embeddings=mc.max_seq_len,
        rms_norm_eps=mc.norm_eps,
        rope_theta=mc.rope_theta,
        tie_word_embeddings=mc.tie_embeddings,
    )
    return LlamaForCausalLM(cfg).eval(), mc


def hf_rounds(model, vocab: int, batch: int, context: int, new_tokens: int, rounds: int) -> list:
    """``rounds`` timings of greedy generate (first token, decode seconds, decode tok/s)."""
    import torch

    ids = torch.randint(0, vocab, (batch, context))
    mask = torch.ones_like(ids)

    def run(n: int) -> float:
        t = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
            )
        elapsed = time.perf_counter() - t
        assert out.shape == (batch, context + n), out.shape
        return elapsed

    run(2)
    rows = []
    while len(rows) < rounds:
        t1, tn = run(1), run(new_tokens + 1)
        if tn <= t1:  # machine noise larger than the decode itself: not a measurement
            print(f"  discarded a round: t(1) {t1:.2f} s >= t({new_tokens + 1}) {tn:.2f} s")
            continue
        rows.append(
            {
                "first_token_s": t1,
                "decode_s": tn - t1,
                "decode_tok_s": batch * new_tokens / (tn - t1),
            }
        )
    return rows


def serve_jax_rounds(python: str, args) -> dict:
    """Our Engine's ``bench --micro generate`` at the same shape (a subprocess of ``python``)."""
    mc = _model_config(args.preset)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ours.json"
        cmd = [
            python, "-m", "serve_jax", "bench", "--micro", "generate", "--config", args.config,
            "--batch", str(args.batch), "--context", str(args.context),
            "--steps", str(args.new_tokens), "--json", str(out),
            f"model.preset={args.preset}", f"model.max_seq_len={min(mc.max_seq_len, 2048)}",
        ]  # fmt: skip
        env = {**os.environ, "JAXSTACK_CPU_DEVICES": "1"}
        subprocess.run(cmd, check=True, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())["result"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small", help="serve_jax model preset whose shape to use")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=256, help="prompt tokens per sequence")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--serve-python",
        default=None,
        help="a Python with serve_jax installed: also run our Engine, alternating pairs",
    )
    ap.add_argument("--pairs", type=int, default=3, help="alternating pairs with --serve-python")
    ap.add_argument("--config", default="cpu_demo", help="our engine config (--serve-python)")
    ap.add_argument(
        "--cpus",
        default=None,
        help="pin this process and ours to these CPUs (e.g. 0 or 0,1), torch to that many "
        "threads: on a shared machine, spinning OpenMP threads of an oversubscribed torch "
        "otherwise slow HF down far more than XLA's pool",
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    try:
        import torch
        import transformers
    except ImportError as e:
        print(f"hf_generate_baseline: needs torch and transformers ({e})", file=sys.stderr)
        return 2
    if args.cpus:
        cpus = {int(c) for c in args.cpus.split(",")}
        os.sched_setaffinity(0, cpus)  # inherited by our subprocess
        torch.set_num_threads(len(cpus))
    model, mc = build_hf_model(args.preset)
    shape = (mc.vocab_size, args.batch, args.context, args.new_tokens, args.rounds)
    res = {
        "peer": "transformers generate",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
        "cpus": sorted(os.sched_getaffinity(0)),
        "preset": args.preset,
        "params": sum(p.numel() for p in model.parameters()),
        "batch": args.batch,
        "context": args.context,
        "new_tokens": args.new_tokens,
    }
    if args.serve_python is None:
        rows = hf_rounds(model, *shape)
        for i, r in enumerate(rows):
            print(
                f"round {i}: first token {r['first_token_s']:.2f} s, decode "
                f"{r['decode_s']:.2f} s, {r['decode_tok_s']:.0f} tok/s"
            )
        res["rounds"] = rows
        res["decode_tok_s_median"] = statistics.median(r["decode_tok_s"] for r in rows)
        res["decode_tok_s_best"] = max(r["decode_tok_s"] for r in rows)
        print(f"HF generate: {res['decode_tok_s_median']:.0f} decode tok/s median")
    else:
        pairs = []
        print(f"{'pair':<6}{'HF tok/s (rounds)':<30}{'serve_jax tok/s (rounds)':<30}ours/HF")
        for i in range(args.pairs):
            hf = hf_rounds(model, *shape)
            ours = serve_jax_rounds(args.serve_python, args)
            hf_tok = [r["decode_tok_s"] for r in hf]
            our_tok = [r["decode_tok_s"] for r in ours["rounds"]]
            row = {
                "hf_rounds": hf,
                "hf_decode_tok_s_median": statistics.median(hf_tok),
                "serve_jax_rounds": ours["rounds"],
                "serve_jax_decode_tok_s_median": ours["decode_tok_s_median"],
            }
            row["ratio"] = row["serve_jax_decode_tok_s_median"] / row["hf_decode_tok_s_median"]
            pairs.append(row)

            def cell(median, values):
                return f"{median:.0f} ({', '.join(f'{x:.0f}' for x in values)})"

            print(
                f"{i + 1:<6}{cell(row['hf_decode_tok_s_median'], hf_tok):<30}"
                f"{cell(row['serve_jax_decode_tok_s_median'], our_tok):<30}{row['ratio']:.2f}",
                flush=True,
            )
        res["pairs"] = pairs
        ratios = [p["ratio"] for p in pairs]
        lo, hi = min(ratios), max(ratios)
        print(f"ours / HF: median {statistics.median(ratios):.2f} ({lo:.2f}-{hi:.2f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
