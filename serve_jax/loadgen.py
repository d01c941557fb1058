"""Load generation: HTTP load against a server, and step timings.

(Offline trace replay on the Engine is `serve_jax.replay.replay_trace`.)

* `http_bench`: replays a trace against a running server's ``/v1/completions`` with streaming,
  timing each streamed chunk on the client (what ``vllm bench serve`` measures, in a
  `serve_jax.metrics.ClientRecord` per request), optionally at most ``max_concurrency`` at once.
* `decode_step_benchmark` / `offload_overlap_benchmark`: step-time comparisons for BENCHMARKS.md
  (paged against dense decode; runs of offload steps at 10%, 25% and 50% of the pages against
  runs of plain steps, overlapped and serial).
* `generate_benchmark`: the whole Engine generating for a fixed batch of prompts, timed the way
  the Hugging Face ``generate`` peer is (``scripts/hf_generate_baseline.py``, same shape).

Prompts are random token ids of the trace's length; outputs are forced to the trace's length
(``ignore_eos``), as benchmark harnesses do with prompt-less traces.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from serve_jax.config import load_engine_config
from serve_jax.engine import Engine
from serve_jax.executor import flat_paged_step
from serve_jax.kv_cache import DenseKVView, make_kv_pools
from serve_jax.metrics import ClientRecord
from serve_jax.model import count_params, init_model
from serve_jax.model_config import get_model_config
from serve_jax.offload import HostKVTier
from serve_jax.sampling import SamplingParams, sample_tokens
from serve_jax.workloads import RequestSpec
from tapas_jax.hardware import get_profile, profile_for_device

__all__ = [
    "synthetic_prompt",
    "http_bench",
    "decode_step_benchmark",
    "generate_benchmark",
    "offload_overlap_benchmark",
]


def synthetic_prompt(n: int, seed: int, low: int = 3, high: int = 259) -> list[int]:
    """``n`` random token ids in [low, high) (byte-tokenizer ids by default)."""
    rng = np.random.default_rng(seed)
    return [int(x) for x in rng.integers(low, high, size=n)]


async def _one_http_request(client, url: str, body: dict, record: ClientRecord) -> None:
    """Sends one streaming completion; fills ``record`` as vLLM's ``RequestFuncOutput``."""
    st = time.perf_counter()
    record.start_time = st
    last = st
    text: list[str] = []
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                record.error = f"HTTP {resp.status_code}: {resp.text[:200]}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    record.error = str(event["error"].get("message", event["error"]))
                    return
                now = time.perf_counter()
                choices = event.get("choices") or []
                if choices:
                    if record.ttft == 0.0:
                        record.ttft = now - st
                    else:
                        record.itl.append(now - last)
                    last = now
                    text.append(choices[0].get("text") or "")
                    record.output_tokens += len(choices[0].get("token_ids") or [])
                usage = event.get("usage")
                if usage:
                    record.output_tokens = usage.get("completion_tokens", record.output_tokens)
                    record.num_preemptions = usage.get("num_preemptions", 0)
        record.latency = last - st
        record.generated_text = "".join(text)
        record.success = record.ttft > 0.0
        if not record.success:
            record.error = "no tokens streamed"
    except Exception as e:  # a failed request is data, as in vLLM's harness
        record.error = f"{type(e).__name__}: {e}"


async def _http_bench(url, trace, model, seed, timeout_s, max_concurrency, progress):
    import httpx

    limit = max_concurrency or 1024
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    records = [ClientRecord(prompt_len=r.prompt_len) for r in trace]

    async def send(idx: int, body: dict) -> None:
        arrival = time.perf_counter()
        if gate is None:
            await _one_http_request(client, url, body, records[idx])
        else:
            async with gate:
                await _one_http_request(client, url, body, records[idx])
        records[idx].queue_time = records[idx].start_time - arrival
        if progress:
            progress(1)

    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        t0 = time.perf_counter()
        tasks = []
        for idx, r in enumerate(trace):
            delay = t0 + r.arrival_time - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            body = {
                "model": model,
                "prompt": synthetic_prompt(r.prompt_len, seed + idx),
                "max_tokens": r.output_len,
                "temperature": 0.0,
                "stream": True,
                "stream_options": {"include_usage": True},
                "ignore_eos": True,
            }
            tasks.append(asyncio.create_task(send(idx, body)))
        await asyncio.gather(*tasks)
        return records, time.perf_counter() - t0


def http_bench(
    url: str,
    trace: Sequence[RequestSpec],
    model: str = "serve-jax",
    seed: int = 0,
    timeout_s: float = 600.0,
    max_concurrency: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> tuple[list[ClientRecord], float]:
    """Replays ``trace`` against ``url`` (streaming completions, greedy, EOS ignored).

    Each request is sent at its arrival time; with ``max_concurrency`` at most that many are in
    flight (the rest wait on the client, as ``vllm bench serve --max-concurrency``).
    ``progress`` is called with 1 as each request ends. Returns one `ClientRecord` per request
    (trace order) and the wall seconds from the first send to the last response.
    """
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {max_concurrency}")
    return asyncio.run(
        _http_bench(url.rstrip("/"), trace, model, seed, timeout_s, max_concurrency, progress)
    )


# ---- step-time benchmarks -----------------------------------------------------------------


def _time_loop(fn, steps: int, warmup: int = 2) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(steps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def generate_benchmark(
    config: str = "cpu_demo",
    batch: int = 16,
    context: int = 256,
    new_tokens: int = 64,
    rounds: int = 3,
    overrides: tuple[str, ...] = (),
    prefill_budget: int | None = None,
) -> dict:
    """Decode tokens/s of the whole Engine (scheduler, paged executor, detokenizer) on a batch.

    ``batch`` prompts of ``context`` random token ids are generated greedily to ``1`` and to
    ``new_tokens + 1`` output tokens (EOS ignored); decode tok/s is
    ``batch * new_tokens / (t(new_tokens + 1) - t(1))``, so prefill and first-token cost cancel
    (a round where machine noise makes ``t(1) >= t(new_tokens + 1)`` is discarded and re-run).
    This is how ``scripts/hf_generate_baseline.py`` times Hugging Face ``generate``.

    ``prefill_budget`` sets ``scheduler.max_num_batched_tokens``; by default ``batch * context``,
    so every prompt is prefilled in the first step and the batch then decodes in lockstep, as
    in ``generate``. With a smaller budget (an online server's, e.g. the config's own) prompts
    are prefilled a few per step and the requests finish staggered, so more decode steps run
    with part of the batch.
    """

    if batch < 1 or context < 1 or new_tokens < 1 or rounds < 1:
        raise ValueError("batch, context, new_tokens and rounds must be >= 1")
    budget = batch * context if prefill_budget is None else prefill_budget
    engine = Engine(
        load_engine_config(config, [f"scheduler.max_num_batched_tokens={budget}", *overrides])
    )
    engine.warmup()
    cfg = engine.model_config
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(0, cfg.vocab_size, context)] for _ in range(batch)]

    def run(n: int) -> float:
        t = time.perf_counter()
        outs = engine.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True))
        elapsed = time.perf_counter() - t
        got = [len(o.token_ids) for o in outs]
        if got != [n] * batch:
            raise RuntimeError(f"expected {n} tokens per request, got {got}")
        return elapsed

    run(2)  # compile anything the warm-up did not
    rows = []
    discarded = 0
    while len(rows) < rounds:
        t1, tn = run(1), run(new_tokens + 1)
        if tn <= t1:  # machine noise larger than the decode itself: not a measurement
            discarded += 1
            if discarded > 3 * rounds:
                raise RuntimeError("decode time not measurable: t(1) >= t(n+1) in every round")
            continue
        rows.append(
            {
                "first_token_s": t1,
                "decode_s": tn - t1,
                "decode_tok_s": batch * new_tokens / (tn - t1),
            }
        )
    tok_s = [r["decode_tok_s"] for r in rows]
    return {
        "engine_config": config,
        "preset": engine.config.model.preset,
        "d_model": cfg.d_model,
        "n_layers": cfg.n_layers,
        "batch": batch,
        "context": context,
        "new_tokens": new_tokens,
        "prefill_budget": budget,
        "rounds": rows,
        "discarded_rounds": discarded,
        "decode_tok_s_median": float(np.median(tok_s)),
        "decode_tok_s_best": float(max(tok_s)),
    }


def _greedy_paged_decode(graphdef, params, tables):
    """``decode(k_pool, v_pool, position) -> (tokens, k_pool, v_pool)``: one greedy decode step
    of every row of ``tables`` at ``position`` through the executor's own jitted step."""

    batch = tables.shape[0]
    leaves, treedef = jax.tree.flatten(params)
    step = flat_paged_step(graphdef, treedef)
    fixed = (
        jnp.ones((batch, 1), bool),  # valid
        tables,
        jnp.zeros((batch,), jnp.int32),  # last
        jnp.zeros((batch,), jnp.float32),  # temperature: greedy
        jnp.ones((batch,), jnp.float32),  # top_p
        jnp.zeros((batch,), jnp.int32),  # seeds
    )
    tok = jnp.full((batch, 1), 7, jnp.int32)

    def decode(k, v, position: int):
        pos = jnp.full((batch, 1), position, jnp.int32)
        ctr = jnp.full((batch,), position, jnp.int32)
        return step(leaves, k, v, tok, pos, *fixed, ctr)

    return decode


def decode_step_benchmark(
    preset: str = "small",
    batch: int = 16,
    context: int = 256,
    block_size: int = 16,
    steps: int = 20,
    seed: int = 0,
    dtype: str = "float32",
    hardware: str | None = None,
) -> dict:
    """Median decode step time, paged (engine kernel) against a dense cache, same model/batch.

    Also reports the step's memory-bandwidth roofline (weights + live KV read once at the
    profile's HBM bandwidth) and the fraction of it the paged step reaches.

    Both steps embed one token per sequence, run the whole model, write K/V and sample a
    token on device; the paged one reads the context through shuffled block tables.
    """

    cfg = get_model_config(preset, max_seq_len=context + steps + 8, dtype=dtype)
    model = init_model(cfg, seed)
    graphdef, params = nnx.split(model)
    max_len = context + steps + 4
    blocks_per_seq = -(-max_len // block_size)
    num_blocks = batch * blocks_per_seq
    rng = np.random.default_rng(seed)
    tables = jnp.asarray(rng.permutation(num_blocks).reshape(batch, blocks_per_seq), jnp.int32)
    k_pool, v_pool = make_kv_pools(cfg, num_blocks, block_size)
    k_dense, v_dense = DenseKVView.zeros(cfg, batch, blocks_per_seq * block_size)
    temp = jnp.zeros((batch,), jnp.float32)
    top_p = jnp.ones((batch,), jnp.float32)
    seeds = jnp.zeros((batch,), jnp.int32)
    valid = jnp.ones((batch, 1), bool)

    leaves, treedef = jax.tree.flatten(params)
    paged_decode = _greedy_paged_decode(graphdef, params, tables)  # what the executor runs

    @functools.partial(jax.jit, donate_argnums=(1, 2))
    def dense_decode(leaves, k, v, tokens, positions, ctr):
        m = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
        view = DenseKVView(k, v, positions, valid)
        h = m.hidden(tokens, positions, view)
        toks = sample_tokens(m.logits(h[:, 0]), temp, top_p, seeds, ctr)
        return toks, view.k, view.v

    state = {"pos": context, "tok": jnp.full((batch, 1), 7, jnp.int32)}
    pools = {"paged": (k_pool, v_pool), "dense": (k_dense, v_dense)}

    def paged():
        toks, k, v = paged_decode(*pools["paged"], state["pos"])
        pools["paged"] = (k, v)
        np.asarray(toks)

    def dense():
        pos = jnp.full((batch, 1), state["pos"], jnp.int32)
        ctr = jnp.full((batch,), state["pos"], jnp.int32)
        k, v = pools["dense"]
        toks, k, v = dense_decode(leaves, k, v, state["tok"], pos, ctr)
        pools["dense"] = (k, v)
        np.asarray(toks)

    # Interleave the two so machine noise hits both alike.
    t_paged, t_dense = [], []
    paged(), dense(), paged(), dense()
    for _ in range(steps):
        t_paged += _time_loop(paged, 1, warmup=0)
        t_dense += _time_loop(dense, 1, warmup=0)
    p, d = float(np.median(t_paged)), float(np.median(t_dense))
    # Memory-bandwidth roofline of a decode step: read every weight and the live KV once.
    if hardware:
        profile = get_profile(hardware)
    else:
        profile = profile_for_device(jax.default_backend(), jax.devices()[0].device_kind)
    param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    kv_bytes = batch * (context + 1) * cfg.kv_bytes_per_token()
    roofline_s = (param_bytes + kv_bytes) / profile.hbm_bandwidth
    return {
        "hardware": profile.name,
        "bytes_per_step": param_bytes + kv_bytes,
        "roofline_step_ms": roofline_s * 1e3,
        "paged_roofline_fraction": roofline_s / p,
        "preset": preset,
        "params": count_params(model),
        "batch": batch,
        "context": context,
        "block_size": block_size,
        "steps": steps,
        "paged_step_ms": p * 1e3,
        "dense_step_ms": d * 1e3,
        "paged_over_dense": p / d,
        "paged_decode_tok_s": batch / p,
        "dense_decode_tok_s": batch / d,
        "backend": jax.default_backend(),
    }


def _offload_runs(
    graphdef,
    params,
    cfg,
    host,
    tables_shape,
    block_size,
    fraction,
    context,
    steps,
    run_length,
    seed,
) -> dict:
    """One fraction of `offload_overlap_benchmark`: median step time of each kind of run."""
    used = tables_shape[0] * tables_shape[1]
    n_off = max(1, round(fraction * used))
    num_blocks = used + n_off
    perm = np.random.default_rng(seed).permutation(num_blocks)
    tables = jnp.asarray(perm[:used].reshape(tables_shape), jnp.int32)
    pairs = [(int(d), i) for i, d in enumerate(perm[used:])]
    decode = _greedy_paged_decode(graphdef, params, tables)
    state = dict(zip(("k", "v"), make_kv_pools(cfg, num_blocks, block_size)))

    def step(offload: bool, wait_own: bool) -> None:
        toks, state["k"], state["v"] = decode(state["k"], state["v"], context)
        if offload:
            host.complete()  # the previous step's copy (none in a serial run)
            host.offload(state["k"], state["v"], pairs)
            if wait_own:
                host.complete()
        np.asarray(toks)

    def run(kind: str) -> None:
        for _ in range(run_length):
            step(kind != "plain", kind == "serial")
        host.complete()

    kinds = ("plain", "overlapped", "serial")
    for kind in kinds:  # compile and warm up
        run(kind)
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for _ in range(steps):
        for kind in kinds:
            times[kind] += _time_loop(functools.partial(run, kind), 1, warmup=0)
    plain, over, serial = (float(np.median(times[k])) / run_length for k in kinds)
    return {
        "fraction": fraction,
        "pages_offloaded_per_step": n_off,
        "offload_bytes_per_step": n_off * block_size * cfg.kv_bytes_per_token(),
        "plain_step_ms": plain * 1e3,
        "offload_step_ms": over * 1e3,
        "serial_offload_step_ms": serial * 1e3,
        "offload_over_plain": over / plain,
        "serial_over_plain": serial / plain,
        "copy_ms": (serial - plain) * 1e3,
    }


def offload_overlap_benchmark(
    preset: str = "small",
    batch: int = 16,
    context: int = 256,
    block_size: int = 16,
    fractions: tuple[float, ...] = (0.1, 0.25, 0.5),
    steps: int = 20,
    run_length: int = 4,
    seed: int = 0,
) -> dict:
    """Decode step time in runs of consecutive offload steps against runs of plain steps.

    For each fraction ``f`` of the pages in use, the pool holds the batch's pages plus ``f`` of
    them more: the pages a victim gives back, offloaded (gather + asynchronous ``device_put`` to
    pinned host memory, as the executor does) once per offload step. Three kinds of run of
    ``run_length`` consecutive steps are timed, interleaved so machine noise hits all alike,
    each over ``steps`` repetitions (median step time = run time / ``run_length``):

    * ``plain``: decode steps, no copy anywhere in the run;
    * ``overlapped``: each step dispatches its decode, waits for the previous step's copy (which
      ran alongside this step's compute, as in the executor), then issues its own; the run's
      last copy is waited for inside the run, so a run pays for every copy it issues;
    * ``serial``: each step waits for its own copy before the next starts (compute + copy: the
      cost of a copy that nothing hides).

    Returns the setup (preset, batch, context, pages in use, run length, host memory kind,
    backend) and one row per fraction under ``fractions``, in the order given (the rows
    ``bench --micro offload`` prints).
    """

    cfg = get_model_config(preset, max_seq_len=context + steps + 8)
    model = init_model(cfg, seed)
    graphdef, params = nnx.split(model)
    max_len = context + 2 * steps + 8
    blocks_per_seq = -(-max_len // block_size)
    used = batch * blocks_per_seq
    tables_shape = (batch, blocks_per_seq)
    host = HostKVTier(jax.devices()[0])
    rows = [
        _offload_runs(
            graphdef,
            params,
            cfg,
            host,
            tables_shape,
            block_size,
            fraction,
            context,
            steps,
            run_length,
            seed,
        )
        for fraction in fractions
    ]
    return {
        "preset": preset,
        "batch": batch,
        "context": context,
        "pages_in_use": used,
        "run_length": run_length,
        "host_memory_kind": host.memory_kind,
        "fractions": rows,
        "backend": jax.default_backend(),
    }
