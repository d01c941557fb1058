"""The peer baseline: Hugging Face transformers ``generate`` at the serve_jax ``small`` shape.

Builds a randomly initialised ``LlamaForCausalLM`` with the ``small`` preset's shapes (d_model 512,
8 layers, 8 query / 4 KV heads, SwiGLU 1408, vocab 512, float32; 24.1M parameters) and times
greedy ``generate`` on a batch of random prompts exactly as ``python -m serve_jax bench --micro
generate`` times our Engine: decode tok/s = batch x new_tokens / (t(new_tokens + 1) - t(1)).

Needs ``torch`` and ``transformers``, which are not dependencies of this project:

    python -m venv /tmp/hf && /tmp/hf/bin/pip install torch transformers
    /tmp/hf/bin/python scripts/hf_generate_baseline.py --batch 16 --context 256 --new-tokens 64

Prints one line per round and writes JSON (``--json``) with the keys of our benchmark.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=256, help="prompt tokens per sequence")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    try:
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as e:
        print(f"hf_generate_baseline: needs torch and transformers ({e})", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=512,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.context))
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
        assert out.shape == (args.batch, args.context + n), out.shape
        return elapsed

    run(2)
    rows = []
    for i in range(args.rounds):
        t1, tn = run(1), run(args.new_tokens + 1)
        tok_s = args.batch * args.new_tokens / (tn - t1)
        rows.append({"first_token_s": t1, "decode_s": tn - t1, "decode_tok_s": tok_s})
        print(f"round {i}: first token {t1:.2f} s, decode {tn - t1:.2f} s, {tok_s:.0f} tok/s")
    res = {
        "peer": "transformers generate",
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "threads": torch.get_num_threads(),
        "params": sum(p.numel() for p in model.parameters()),
        "batch": args.batch,
        "context": args.context,
        "new_tokens": args.new_tokens,
        "rounds": rows,
        "decode_tok_s_median": statistics.median(r["decode_tok_s"] for r in rows),
        "decode_tok_s_best": max(r["decode_tok_s"] for r in rows),
    }
    print(f"HF generate: {res['decode_tok_s_median']:.0f} decode tok/s median")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
