"""Commands ``serve``, ``replay`` and ``bench`` (``python -m serve_jax <command> --help``).

* ``serve``: the OpenAI-style HTTP server on 127.0.0.1 (``--config``, ``--port``).
* ``replay``: the engine on a trace offline (no HTTP); prints the metrics table, writes JSON.
* ``bench``: with ``--url``, the load generator against a running server; with ``--micro
  decode|offload``, the step-time benchmarks of BENCHMARKS.md.
Trailing ``key=value`` arguments override the engine config (``cache.num_device_blocks=64``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

__all__ = ["main"]


def _common_trace_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--trace",
        default="conv",
        help="CSV trace, or 'conv'/'code' for the shipped samples (default conv)",
    )
    p.add_argument("--num-requests", type=int, default=50, help="requests taken from the trace")
    p.add_argument("--skip", type=int, default=0, help="trace rows skipped first")
    p.add_argument(
        "--rate",
        type=float,
        default=None,
        help="arrival rate req/s (gamma process); default: the trace's timestamps",
    )
    p.add_argument(
        "--burstiness", type=float, default=1.0, help="gamma shape of inter-arrivals (1 = Poisson)"
    )
    p.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="multiply trace timestamps by this (with no --rate)",
    )
    p.add_argument(
        "--token-scale", type=float, default=1.0, help="multiply prompt and output lengths by this"
    )
    p.add_argument("--max-input-len", type=int, default=None, help="clip prompt lengths")
    p.add_argument("--max-output-len", type=int, default=None, help="clip output lengths")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=200.0)
    p.add_argument("--json", default=None, help="write the summary here")


def _load_trace(args, max_prompt=None, max_output=None):
    import dataclasses

    from serve_jax.traces import load_trace, sample_trace_path, scale_lengths, with_arrivals

    path = sample_trace_path(args.trace) if args.trace in ("conv", "code") else args.trace
    trace = load_trace(path, limit=args.num_requests, skip=args.skip)
    if args.rate is None and args.time_scale != 1.0:
        trace = [dataclasses.replace(r, arrival_s=r.arrival_s * args.time_scale) for r in trace]
    trace = with_arrivals(trace, args.rate, args.burstiness, args.seed)
    mp = (
        min(x for x in (args.max_input_len, max_prompt) if x)
        if (args.max_input_len or max_prompt)
        else None
    )
    mo = (
        min(x for x in (args.max_output_len, max_output) if x)
        if (args.max_output_len or max_output)
        else None
    )
    return str(path), scale_lengths(trace, args.token_scale, mp, mo)


def _write_json(path, payload) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(payload, indent=2))
        print(f"wrote {path}")


def _engine_config(args):
    from serve_jax.config import load_engine_config

    overrides = list(args.overrides)
    if getattr(args, "policy", None):
        overrides.append(f"scheduler.policy={args.policy}")
    return load_engine_config(args.config, overrides)


def _replay(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m serve_jax replay", description=__doc__)
    p.add_argument("--config", default="cpu_demo", help="preset name or YAML path")
    p.add_argument("--policy", default=None, help="victim policy (default from the config)")
    _common_trace_args(p)
    p.add_argument("overrides", nargs="*", help="config overrides key=value")
    args = p.parse_args(argv)
    from serve_jax.engine import Engine
    from serve_jax.loadgen import replay_trace
    from serve_jax.metrics import Slo, format_table, summarize

    cfg = _engine_config(args)
    engine = Engine(cfg)
    # Leave room for the output within the context.
    max_prompt = engine.max_model_len // 2
    path, trace = _load_trace(args, max_prompt, engine.max_model_len - max_prompt)
    print(
        f"replaying {len(trace)} requests from {path} on {cfg.model.preset} "
        f"(policy {engine.policy.name}, {cfg.cache.num_device_blocks} device pages)",
        flush=True,
    )
    records, duration = replay_trace(engine, trace, seed=args.seed)
    summary = summarize(records, duration, Slo(args.slo_ttft_ms, args.slo_tpot_ms))
    summary["engine"] = engine.stats()
    print(format_table(summary, "Offline replay result"))
    _write_json(
        args.json, {"command": "replay", "config": args.config, "trace": path, "summary": summary}
    )
    return 0


def _bench(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m serve_jax bench", description=__doc__)
    p.add_argument("--url", default=None, help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="model id (default: the server's first)")
    p.add_argument(
        "--micro",
        choices=["decode", "offload", "generate"],
        default=None,
        help="step-time benchmark instead of HTTP load",
    )
    p.add_argument("--preset", default="small", help="model preset for --micro decode|offload")
    p.add_argument(
        "--prefill-budget",
        type=int,
        default=None,
        help="--micro generate: token budget per step (default batch x context: all prompts "
        "prefill in the first step, as HF generate does)",
    )
    p.add_argument(
        "--engine-config",
        default="cpu_demo",
        help="engine preset or YAML for --micro generate",
    )
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--context", type=int, default=256)
    p.add_argument(
        "--steps", type=int, default=20, help="timed steps (--micro generate: new tokens)"
    )
    p.add_argument("--dtype", default="float32", help="model dtype for --micro decode")
    p.add_argument(
        "--hardware",
        default=None,
        help="profile for the roofline (default: by backend, cpu/h200/tpu-v5e)",
    )
    _common_trace_args(p)
    args = p.parse_args(argv)
    if args.micro:
        from serve_jax import loadgen

        if args.micro == "generate":
            res = loadgen.generate_benchmark(
                args.engine_config,
                args.batch,
                args.context,
                args.steps,
                rounds=3,
                prefill_budget=args.prefill_budget,
            )
            print(f"{'round':<8}{'first token s':>15}{'decode s':>10}{'decode tok/s':>14}")
            for i, r in enumerate(res["rounds"]):
                print(
                    f"{i:<8}{r['first_token_s']:>15.2f}{r['decode_s']:>10.2f}"
                    f"{r['decode_tok_s']:>14.0f}"
                )
            print(
                f"Engine ({res['engine_config']}, {res['preset']}): batch {res['batch']}, "
                f"prompt {res['context']}, {res['new_tokens']} new tokens, prefill budget "
                f"{res['prefill_budget']}: "
                f"{res['decode_tok_s_median']:.0f} decode tok/s median"
            )
        elif args.micro == "decode":
            res = loadgen.decode_step_benchmark(
                args.preset,
                args.batch,
                args.context,
                steps=args.steps,
                dtype=args.dtype,
                hardware=args.hardware,
            )
            print(f"{'step':<28}{'ms':>10}{'tok/s':>12}")
            print(
                f"{'paged decode':<28}{res['paged_step_ms']:>10.2f}"
                f"{res['paged_decode_tok_s']:>12.0f}"
            )
            print(
                f"{'dense decode':<28}{res['dense_step_ms']:>10.2f}"
                f"{res['dense_decode_tok_s']:>12.0f}"
            )
            print(
                f"paged / dense = {res['paged_over_dense']:.3f} "
                f"({res['preset']}, {res['params'] / 1e6:.1f}M params, batch {res['batch']}, "
                f"context {res['context']})"
            )
            print(
                f"roofline ({res['hardware']}): {res['roofline_step_ms']:.2f} ms/step, paged "
                f"reaches {100 * res['paged_roofline_fraction']:.1f}%"
            )
        else:
            res = loadgen.offload_overlap_benchmark(
                args.preset, args.batch, args.context, steps=args.steps
            )
            print(f"{'decode step':<36}{'ms':>10}")
            print(f"{'no offload':<36}{res['no_offload_step_ms']:>10.2f}")
            print(f"{'offload in flight':<36}{res['offload_step_ms']:>10.2f}")
            print(
                f"offload / none = {res['offload_over_none']:.3f} "
                f"({res['pages_offloaded_per_step']} of {res['pages_in_use']} pages, "
                f"{res['offload_bytes_per_step'] / 2**20:.1f} MiB per step to "
                f"{res['host_memory_kind']})"
            )
        _write_json(args.json, {"command": f"bench --micro {args.micro}", "result": res})
        return 0
    if not args.url:
        p.error("give --url URL (load generator) or --micro decode|offload")
    import httpx

    from serve_jax.loadgen import http_bench
    from serve_jax.metrics import Slo, format_table, summarize

    url = args.url.rstrip("/")
    try:
        models = httpx.get(f"{url}/v1/models", timeout=10).json()["data"]
    except Exception as e:
        print(f"cannot reach {url}/v1/models: {e}", file=sys.stderr)
        return 1
    model = args.model or models[0]["id"]
    max_len = models[0].get("max_model_len")
    max_prompt = max_len // 2 if max_len else None
    path, trace = _load_trace(args, max_prompt, (max_len - max_prompt) if max_len else None)
    print(f"sending {len(trace)} requests from {path} to {url} (model {model})", flush=True)
    records, duration = http_bench(url, trace, model=model, seed=args.seed)
    summary = summarize(records, duration, Slo(args.slo_ttft_ms, args.slo_tpot_ms))
    try:
        summary["server_preemptions"] = _scrape_preemptions(url)
    except Exception:
        pass
    print(format_table(summary))
    _write_json(args.json, {"command": "bench", "url": url, "trace": path, "summary": summary})
    return 0


def _scrape_preemptions(url: str) -> float:
    import httpx

    text = httpx.get(f"{url}/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith("serve_jax_preemptions_total "):
            return float(line.split()[1])
    return float("nan")


def _serve(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m serve_jax serve", description=__doc__)
    p.add_argument("--config", default="cpu_demo", help="preset name or YAML path")
    p.add_argument("--host", default=None, help="bind address (default from config: 127.0.0.1)")
    p.add_argument("--port", type=int, default=None)
    p.add_argument("--policy", default=None)
    p.add_argument("overrides", nargs="*", help="config overrides key=value")
    args = p.parse_args(argv)
    from serve_jax.server import run_server

    cfg = _engine_config(args)
    run_server(cfg, host=args.host, port=args.port)
    return 0


def _enable_compilation_cache() -> None:
    """Persists XLA compilations (``SERVE_JAX_CACHE_DIR``, default ~/.cache/serve_jax/xla)."""
    import os

    import jax

    path = os.environ.get("SERVE_JAX_CACHE_DIR", os.path.expanduser("~/.cache/serve_jax/xla"))
    if path and not jax.config.jax_compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", path)


def main(argv: list[str]) -> int:
    """Entry point; ``argv[0]`` is the command name (serve, replay or bench)."""
    from tapas_jax.config import ConfigError

    commands = {"serve": _serve, "replay": _replay, "bench": _bench}
    if not argv or argv[0] not in commands:
        print(f"serve_jax.cli: expected one of {sorted(commands)}", file=sys.stderr)
        return 2
    _enable_compilation_cache()
    try:
        return commands[argv[0]](argv[1:])
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
