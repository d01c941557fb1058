"""Commands ``serve``, ``replay`` and ``bench`` (``python -m serve_jax <command> --help``).

* ``serve``: the OpenAI-style HTTP server on 127.0.0.1 (``--config``, ``--port``).
* ``replay``: the engine on a workload offline (no HTTP); prints the metrics table, writes JSON.
* ``bench``: with ``--url``, the load generator against a running server (``vllm bench serve``'s
  table and flat ``--save-result`` JSON, ``--max-concurrency``, ``--percentile-metrics``,
  ``--metric-percentiles``); with ``--micro decode|offload|generate``, the step-time benchmarks
  of BENCHMARKS.md.

``serve`` and ``replay`` run an engine config (`serve_jax.config.EngineConfig`): ``--config
<preset or .yaml>`` plus trailing ``key=value`` overrides (``cache.num_device_blocks=64``,
``scheduler.policy=predictive``; all listed by ``--help``); ``--kv-cache-memory-fraction F``
sizes the device pages from memory (`serve_jax.sizing`). ``replay`` and ``bench`` pick their
requests with the workload flags ``simulate`` has too (`serve_jax.cli_args`), and report the
metrics of `serve_jax.metrics` (ms).
"""

from __future__ import annotations

import os
import time

import httpx
import jax
from prometheus_client.parser import text_string_to_metric_families
from tqdm import tqdm

from serve_jax import loadgen
from serve_jax.cli_args import add_slo_args, add_tqdm_flag, add_workload_args, workload_config
from serve_jax.config import EngineConfig, load_engine_config
from serve_jax.engine import Engine
from serve_jax.metrics import (
    PERCENTILE_METRICS,
    Slo,
    bench_result,
    format_bench_table,
    format_table,
    summarize,
)
from serve_jax.replay import replay_trace
from serve_jax.server import run_server
from serve_jax.workloads import WorkloadConfig, build_workload
from tapas_jax.commands import command_parser, write_json

__all__ = ["main"]

_TRACE_DEFAULTS = WorkloadConfig(name="conv", num_requests=50)


def _engine_parser(command: str, description: str):
    return command_parser(
        "serve_jax",
        command,
        EngineConfig,
        description=description,
        example="cache.num_device_blocks=64",
    )


def _add_policy_flag(p) -> None:
    p.add_argument("--policy", default=None, help="victim policy; same as scheduler.policy=...")


def _add_model_flag(p) -> None:
    p.add_argument(
        "--model",
        dest="hf_model",
        default=None,
        metavar="DIR",
        help="a Hugging Face checkpoint: directory, cache folder or cached repo id (never "
        "downloaded); same as model.path=DIR model.name=DIR",
    )


def _add_memory_flag(p) -> None:
    p.add_argument(
        "--kv-cache-memory-fraction",
        type=float,
        default=None,
        metavar="F",
        help="size the device KV pages from F of the device's memory after weights and "
        "activations (vLLM's --gpu-memory-utilization); same as "
        "cache.kv_cache_memory_fraction=F",
    )


def _engine_config(args) -> EngineConfig:
    """The engine config of ``--config`` (default cpu_demo), ``--model``, ``--policy``,
    ``--kv-cache-memory-fraction`` and the overrides (which win)."""
    model = getattr(args, "hf_model", None)
    overrides = [f"model.path={model}", f"model.name={model}"] if model else []
    overrides += [f"scheduler.policy={args.policy}"] if args.policy else []
    fraction = getattr(args, "kv_cache_memory_fraction", None)
    overrides += [f"cache.kv_cache_memory_fraction={fraction}"] if fraction is not None else []
    return load_engine_config(args.config or "cpu_demo", overrides + list(args.overrides))


def _replay(argv: list[str]) -> int:
    p = _engine_parser("replay", "Run the engine offline on a workload; print its metrics.")
    _add_policy_flag(p)
    _add_model_flag(p)
    _add_memory_flag(p)
    add_workload_args(p, _TRACE_DEFAULTS)
    add_slo_args(p, 2000.0, 200.0)
    p.add_argument("--json", default=None, help="write the summary here")
    add_tqdm_flag(p)
    args = p.parse_args(argv)
    cfg = _engine_config(args)
    engine = Engine(cfg)
    cfg = engine.config  # with the sized pages, when sized from memory
    if engine.kv_sizing is not None:
        print(engine.kv_sizing.describe(), flush=True)
    # Leave room for the output within the context.
    max_prompt = engine.max_model_len // 2
    wcfg = workload_config(args)
    workload = build_workload(
        wcfg, max_prompt=max_prompt, max_output=engine.max_model_len - max_prompt
    )
    print(
        f"replaying {len(workload.requests)} requests of {workload.name} on "
        f"{cfg.model.path or cfg.model.preset} "
        f"(policy {engine.policy.name}, {cfg.cache.num_device_blocks} device pages)",
        flush=True,
    )
    with tqdm(total=len(workload.requests), disable=args.disable_tqdm, unit="req") as bar:
        run = replay_trace(
            engine, workload.requests, seed=wcfg.seed, progress=lambda n: bar.update(n - bar.n)
        )
    records, duration = run.records, run.duration
    summary = summarize(records, duration, Slo(args.slo_ttft_ms, args.slo_tpot_ms))
    summary["engine"] = engine.stats()
    print(format_table(summary, "Offline replay result"))
    write_json(
        args.json,
        {
            "command": "replay",
            "config": args.config or "cpu_demo",
            "workload": workload.name,
            "summary": summary,
        },
    )
    return 0


def _bench(argv: list[str]) -> int:
    p = _engine_parser(
        "bench",
        "Load generator against a running server (--url), or a step-time benchmark (--micro); "
        "--config and the overrides are the engine config of --micro generate.",
    )
    p.add_argument("--url", default=None, help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="served model id (default: the server's first)")
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
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--context", type=int, default=256)
    p.add_argument(
        "--steps", type=int, default=20, help="timed steps (--micro generate: new tokens)"
    )
    p.add_argument("--dtype", default="float32", help="model dtype for --micro decode")
    p.add_argument(
        "--hardware",
        default=None,
        help="chip profile of the roofline (default: the local backend's)",
    )
    p.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="most requests in flight; the others wait on the client (vLLM's meaning)",
    )
    p.add_argument(
        "--percentile-metrics",
        default=",".join(PERCENTILE_METRICS),
        help="comma-separated metrics that get mean/median/std/percentile keys, of "
        f"{','.join(PERCENTILE_METRICS)} (default all four; vLLM's default leaves out e2el)",
    )
    p.add_argument(
        "--metric-percentiles",
        default="99",
        help='comma-separated percentiles of those metrics, e.g. "25,50,75" (default 99)',
    )
    add_workload_args(p, _TRACE_DEFAULTS)
    add_slo_args(p, 2000.0, 200.0)
    p.add_argument(
        "--json",
        default=None,
        help="write the result here: the flat JSON of vllm bench serve --save-result "
        "--save-detailed (for --micro: that benchmark's result)",
    )
    add_tqdm_flag(p)
    args = p.parse_args(argv)
    if args.micro:
        if args.micro == "generate":
            res = loadgen.generate_benchmark(
                args.config or "cpu_demo",
                args.batch,
                args.context,
                args.steps,
                rounds=3,
                overrides=tuple(args.overrides),
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
            print(
                f"decode steps in runs of {res['run_length']} (batch {res['batch']}, context "
                f"{res['context']}, {res['pages_in_use']} pages in use; copies to "
                f"{res['host_memory_kind']}), median ms per step"
            )
            head = ("pages", "MiB/step", "plain", "overlapped", "serial", "ovl/plain", "ser/plain")
            print("".join(f"{h:>11}" for h in head))
            for row in res["fractions"]:
                pages = f"{row['pages_offloaded_per_step']} ({100 * row['fraction']:.0f}%)"
                cells = (
                    pages,
                    f"{row['offload_bytes_per_step'] / 2**20:.1f}",
                    f"{row['plain_step_ms']:.2f}",
                    f"{row['offload_step_ms']:.2f}",
                    f"{row['serial_offload_step_ms']:.2f}",
                    f"{row['offload_over_plain']:.3f}",
                    f"{row['serial_over_plain']:.3f}",
                )
                print("".join(f"{c:>11}" for c in cells))
        write_json(args.json, {"command": f"bench --micro {args.micro}", "result": res})
        return 0
    if not args.url:
        p.error("give --url URL (load generator) or --micro decode|offload|generate")
    if args.config or args.overrides:
        raise ValueError("--config and key=value overrides apply to --micro generate only")
    url = args.url.rstrip("/")
    metrics = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
    try:
        percentiles = [float(x) for x in args.metric_percentiles.split(",")]
    except ValueError:
        raise ValueError(
            f"--metric-percentiles: not numbers: {args.metric_percentiles!r}"
        ) from None
    try:
        models = httpx.get(f"{url}/v1/models", timeout=10).json()["data"]
    except (httpx.HTTPError, ValueError, KeyError) as e:
        raise OSError(f"cannot list the models of {url}: {type(e).__name__}") from None
    model = args.model or models[0]["id"]
    max_len = models[0].get("max_model_len")
    max_prompt = max_len // 2 if max_len else None
    wcfg = workload_config(args)
    workload = build_workload(
        wcfg, max_prompt=max_prompt, max_output=(max_len - max_prompt) if max_len else None
    )
    requests = workload.requests
    print(
        f"sending {len(requests)} requests of {workload.name} to {url} (model {model}, "
        f"max concurrency {args.max_concurrency})",
        flush=True,
    )
    preemptions_before = _scrape_preemptions(url)
    with tqdm(total=len(requests), disable=args.disable_tqdm, unit="req") as bar:
        records, duration = loadgen.http_bench(
            url,
            requests,
            model=model,
            seed=wcfg.seed,
            max_concurrency=args.max_concurrency,
            progress=bar.update,
        )
    last_arrival = max((r.arrival_time for r in requests), default=0.0)
    result = {
        "date": time.strftime("%Y%m%d-%H%M%S"),
        "endpoint_type": "openai",
        "backend": "openai",
        "label": "serve_jax",
        "model_id": model,
        "tokenizer_id": None,
        "num_prompts": len(requests),
        # The workload's offered rate (its arrivals), "inf" when every request arrives at 0.
        "request_rate": len(requests) / last_arrival if last_arrival > 0 else "inf",
        "burstiness": wcfg.burstiness,
        "max_concurrency": args.max_concurrency,
        **bench_result(
            records, duration, metrics, percentiles, Slo(args.slo_ttft_ms, args.slo_tpot_ms)
        ),
        "workload": workload.name,
        # vllm:num_preemptions_total moved by this much during the run
        "server_preemptions": _scrape_preemptions(url) - preemptions_before,
    }
    print(format_bench_table(result, metrics))
    write_json(args.json, result)
    return 0


def _scrape_preemptions(url: str) -> float:
    """The server's preemption counter from ``/metrics`` (NaN when it cannot be read)."""
    try:
        text = httpx.get(f"{url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return float("nan")
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "vllm:num_preemptions_total":
                return float(sample.value)
    return float("nan")


def _serve(argv: list[str]) -> int:
    p = _engine_parser("serve", "Start the OpenAI-style HTTP server (127.0.0.1 by default).")
    p.add_argument("--host", default=None, help="bind address; same as server.host=...")
    p.add_argument("--port", type=int, default=None, help="TCP port; same as server.port=...")
    _add_policy_flag(p)
    _add_model_flag(p)
    _add_memory_flag(p)
    args = p.parse_args(argv)
    cfg = _engine_config(args)
    run_server(cfg, host=args.host, port=args.port)
    return 0


def _enable_compilation_cache() -> None:
    """Persists XLA compilations (``SERVE_JAX_CACHE_DIR``, default ~/.cache/serve_jax/xla)."""
    path = os.environ.get("SERVE_JAX_CACHE_DIR", os.path.expanduser("~/.cache/serve_jax/xla"))
    if path and not jax.config.jax_compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", path)


def main(argv: list[str]) -> int:
    """Entry point; ``argv[0]`` is the command name (serve, replay or bench).

    User errors (a bad config, workload or file) are raised for `tapas_jax.commands.dispatch`,
    which prints them as one line (exit status 2).
    """
    commands = {"serve": _serve, "replay": _replay, "bench": _bench}
    if not argv or argv[0] not in commands:
        raise ValueError(f"serve_jax.cli: expected one of {sorted(commands)}")
    _enable_compilation_cache()
    return commands[argv[0]](argv[1:])
