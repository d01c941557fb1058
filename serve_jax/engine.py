"""The serving engine: requests in, streamed tokens out, one scheduler and one JAX executor.

::

    engine = Engine(load_engine_config("tiny_cpu"))
    rid = engine.add_request("Hello", SamplingParams(max_tokens=8))
    while engine.has_unfinished():
        for out in engine.step():       # RequestOutput per request that got tokens
            print(out.request_id, out.new_text, out.finished)

`Engine` is `serve_jax.core.EngineCore` (the one ``schedule -> execute -> update_from_output``
loop, shared with the simulator) plus a tokenizer, a detokenizer and text: `Engine.step` runs one
core step, then turns each request's new ids into text incrementally (one decode step per token,
`serve_jax.tokenizer.Tokenizer.decoder`), applies stop strings, and returns what is new
(`serve_jax.request_output`). A
request stops at any of the tokenizer's EOS ids (unless ``ignore_eos``) or its
``stop_token_ids``; that token is not text. Stop strings and stop ids count only from
``min_tokens`` output tokens on (the sampler bans the stop ids before that).

A request with ``n > 1`` samples is fanned out as vLLM V1 does: sample i is its own scheduler
request ``f"{i}_{id}"`` with seed ``seed + i``. Sample 0 is queued first; the others join once
its prompt is computed, so they find the prompt's full pages in the prefix cache
(`serve_jax.kv_blocks`) and share them (reference counts) instead of computing a copy; only the
prompt's last, partial page is computed per sample. Their outputs carry the request's id and
the sample's ``index``.

The model is a preset with random or own-format weights, or a Hugging Face checkpoint
(``model.path``: `serve_jax.hf_config`, `serve_jax.hf_checkpoint`). The
executor is the JAX one (`serve_jax.executor.JaxExecutor`, built from the config) unless one is
passed in (``executor=``, e.g. the simulator's). It is single-threaded; the HTTP server drives it
from one background thread (`serve_jax.server.EngineLoop`). Time comes from an injectable clock
so metrics can be checked in tests.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Sequence

import jax

from serve_jax.config import EngineConfig
from serve_jax.core import EngineCore, StepOutput
from serve_jax.executor import JaxExecutor
from serve_jax.hf_checkpoint import load_hf_model
from serve_jax.hf_config import hf_model_config, resolve_model_dir
from serve_jax.model import init_model, load_safetensors
from serve_jax.model_config import ModelConfig, get_model_config
from serve_jax.preemption import get_policy
from serve_jax.request_output import RequestMetrics, RequestOutput, SampleState
from serve_jax.sampling import SamplingParams, SequenceSampling
from serve_jax.scheduler import (
    CostHints,
    Executor,
    FcfsLastPolicy,
    PreemptMode,
    Request,
    RequestStatus,
    Scheduler,
    VictimPolicy,
)
from serve_jax.sizing import size_kv_cache
from serve_jax.tokenizer import load_tokenizer
from tapas_jax.hardware import profile_for_device
from tapas_jax.mesh import make_mesh

__all__ = ["Engine", "RequestOutput", "RequestMetrics", "resolve_policy", "MeasuredCostHints"]
# RequestOutput and RequestMetrics live in serve_jax.request_output; they are re-exported here,
# where callers of `Engine.step` look for them.


class MeasuredCostHints(CostHints):
    """Cost hints fitted online from the executor's step times (exponential moving averages)."""

    def __init__(self, host_link_bytes_per_s: float, block_bytes: int, alpha: float = 0.2):
        self.alpha = alpha
        self.block_bytes = block_bytes
        self.host_link = host_link_bytes_per_s
        self.per_prefill_token = 2e-4
        self.decode_base = 5e-3
        self.per_decode_seq = 2e-4

    def observe(self, prefill_tokens: int, decode_seqs: int, seconds: float) -> None:
        """Updates the fit from one step's composition and duration."""
        a = self.alpha
        if prefill_tokens and not decode_seqs:
            self.per_prefill_token += a * (seconds / prefill_tokens - self.per_prefill_token)
        elif decode_seqs and not prefill_tokens:
            predicted = self.decode_base + self.per_decode_seq * decode_seqs
            self.decode_base = max(0.0, self.decode_base + a * (seconds - predicted))

    def prefill_seconds(self, num_tokens: int) -> float:
        return self.per_prefill_token * num_tokens

    def transfer_seconds(self, num_blocks: int) -> float:
        return num_blocks * self.block_bytes / self.host_link

    def decode_seconds(self, batch_size: int, context_tokens: int) -> float:
        return self.decode_base + self.per_decode_seq * batch_size

    def observe_step(self, out: StepOutput) -> None:
        """`serve_jax.core.StepObserver`: fits on a step with a measured duration."""
        seconds = out.executor_output.step_seconds
        if seconds is not None:
            plan = out.scheduler_output
            self.observe(sum(c.num_tokens for c in plan.prefills), len(plan.decodes), seconds)


def resolve_policy(name: str, mode: str = "recompute") -> VictimPolicy:
    """A victim policy by name; ``mode`` is the preemption mode of ``fcfs_last``.

    Raises:
      ValueError: an unknown policy or mode.
    """
    try:
        preempt_mode = PreemptMode(mode)
    except ValueError:
        raise ValueError(f"preempt_mode must be 'recompute' or 'offload', got {mode!r}") from None
    if name == "fcfs_last":
        return FcfsLastPolicy(preempt_mode)
    return get_policy(name)


def _serving_dtype(dtype: str) -> str:
    """``auto``: float32 on CPU, bfloat16 on accelerators; other names pass through."""
    if dtype != "auto":
        return dtype
    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


def _model_config(mc) -> ModelConfig:
    """The `ModelConfig` of a `serve_jax.config.ModelSection` (HF config.json or a preset)."""
    dtype = _serving_dtype(mc.dtype)
    if mc.path:
        if mc.checkpoint:
            raise ValueError("model.path and model.checkpoint exclude each other; set one")
        return hf_model_config(mc.path, dtype, mc.max_seq_len)
    overrides = {"dtype": dtype}
    if mc.max_seq_len:
        overrides["max_seq_len"] = mc.max_seq_len
    return get_model_config(mc.preset, **overrides)


class Engine:
    """Continuous-batching engine over a paged KV cache with a host tier.

    Args:
      config: engine config (default: `EngineConfig()` with the tiny model).
      model: a `serve_jax.model.Decoder` to serve instead of building one from the config.
      tokenizer: a tokenizer instead of the configured one.
      policy: a victim policy instead of the configured one.
      clock: seconds since some origin; default ``time.monotonic``.
      executor: an executor instead of the JAX one (then no model is built: the model's
        shape comes from the config's preset).
      costs: the policy's cost hints (default: `MeasuredCostHints` fitted online on step times,
        starting from the host link of the device JAX runs on).
    """

    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        model=None,
        tokenizer=None,
        policy: VictimPolicy | None = None,
        clock: Callable[[], float] = time.monotonic,
        executor: Executor | None = None,
        costs: CostHints | None = None,
    ):
        self.config = config or EngineConfig()
        mc, ec = self.config.model, self.config.executor
        mesh = _make_mesh(ec.mesh) if executor is None else None
        if model is None:
            model_config = _model_config(mc)
            if executor is None and mc.path:
                model = load_hf_model(mc.path, model_config, mesh, ec.plan_memory_limit_bytes)
            elif executor is None:
                model = init_model(model_config, mc.seed)
                if mc.checkpoint:
                    load_safetensors(model, mc.checkpoint)
        else:
            model_config = model.cfg
        self.model = model
        self.model_config = model_config
        if tokenizer is None:
            source = mc.tokenizer or (str(resolve_model_dir(mc.path)) if mc.path else None)
            tokenizer = load_tokenizer(source)
        self.tokenizer = tokenizer
        if self.tokenizer.vocab_size > self.model_config.vocab_size:
            raise ValueError(
                f"tokenizer has {self.tokenizer.vocab_size} ids, model vocab_size is "
                f"{self.model_config.vocab_size}"
            )
        # cache.kv_cache_memory_fraction: device pages from memory (serve_jax.sizing)
        self.config, self.kv_sizing = size_kv_cache(self.config, self.model_config, model, mesh)
        cc, sc = self.config.cache, self.config.scheduler
        self.policy = policy or resolve_policy(sc.policy, sc.preempt_mode)
        if costs is None:
            hw = profile_for_device(jax.default_backend(), jax.devices()[0].device_kind)
            block_bytes = cc.block_size * self.model_config.kv_bytes_per_token()
            costs = MeasuredCostHints(hw.host_link_bandwidth, block_bytes)
        self.costs = costs
        scheduler = Scheduler(
            cc.num_device_blocks,
            cc.num_host_blocks,
            block_size=cc.block_size,
            max_num_seqs=sc.max_num_seqs,
            max_num_batched_tokens=sc.max_num_batched_tokens,
            policy=self.policy,
            costs=self.costs,
            max_model_len=self.model_config.max_seq_len,
            enable_prefix_caching=cc.enable_prefix_caching,
            host_prefix_caching=cc.host_prefix_caching,
            host_retention=cc.host_retention,
        )
        built = executor is None
        if built:
            executor = JaxExecutor(
                model,
                cc.num_device_blocks,
                cc.block_size,
                use_host_tier=cc.num_host_blocks > 0,
                min_batch=ec.min_batch,
                prefill_rows=ec.prefill_rows,
                min_chunk=ec.min_chunk,
                min_table_blocks=ec.min_table_blocks,
                mesh=mesh,
                plan_memory_limit_bytes=ec.plan_memory_limit_bytes,
            )
        observers = [costs.observe_step] if isinstance(costs, MeasuredCostHints) else []
        self.core = EngineCore(scheduler, executor, clock, observers)
        self.scheduler = scheduler
        self.executor = executor
        self.clock = clock
        self._tracked: dict[str, SampleState] = {}
        self._samples: dict[str, list[str]] = {}
        """Scheduler ids of each caller-visible request's samples (unfinished ones)."""
        self._held: dict[str, list[Request]] = {}
        """Samples 1..n-1 waiting for sample 0's prompt to be computed (then cached)."""
        self._ids = itertools.count()
        self.num_generated_tokens = 0
        if built and self.config.executor.warmup:
            self.warmup()

    @property
    def num_steps(self) -> int:
        """Executed steps so far."""
        return self.core.num_steps

    def warmup(self) -> int:
        """Compiles the executor's step shapes now (instead of on first use); returns count."""
        sc = self.config.scheduler
        # A prefill chunk never exceeds the token budget nor the model's context length.
        longest = min(sc.max_num_batched_tokens, self.max_model_len)
        return self.executor.warmup(sc.max_num_seqs, longest)

    @property
    def max_model_len(self) -> int:
        """Longest prompt + max_tokens a request may ask for."""
        return self.scheduler.max_model_len

    # ---- requests ------------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
    ) -> str:
        """Queues a request (``params.n`` samples of it); returns its id.

        Raises:
          ValueError: an empty or too long prompt, token ids outside the vocabulary, or
            ``stop_token_ids`` outside it.
        """
        params = params or SamplingParams()
        vocab = self.model_config.vocab_size
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt token ids out of range [0, vocab): {bad[:5]}")
        if not ids:
            raise ValueError("prompt is empty")
        bad = [t for t in params.stop_token_ids if t >= vocab]
        if bad:
            raise ValueError(f"stop_token_ids out of range [0, {vocab}): {bad[:5]}")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                f"context length {self.max_model_len}"
            )
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self._samples:
            raise ValueError(f"duplicate request id {rid!r}")
        stop_ids = frozenset(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= self.tokenizer.eos_ids
        arrival = self.clock() if arrival_time is None else arrival_time
        samples = []
        for i in range(params.n):
            sid = rid if params.n == 1 else f"{i}_{rid}"
            seed = (params.seed + i) % 2**31
            p = params if params.n == 1 else dataclasses.replace(params, n=1, seed=seed)
            req = Request(sid, list(ids), p.max_tokens, arrival, stop_token_ids=stop_ids)
            req.sampling = SequenceSampling(p, req.prompt_token_ids, req.output_token_ids, stop_ids)
            samples.append(req)
        self.scheduler.add_request(samples[0])
        if len(samples) > 1:
            self._held[rid] = samples[1:]
        self._samples[rid] = [r.request_id for r in samples]
        for i, req in enumerate(samples):
            logprobs = [] if params.logprobs is not None else None
            decoder = self.tokenizer.decoder(ids)
            self._tracked[req.request_id] = SampleState(
                req, req.sampling.params, decoder, rid, i, logprobs
            )
        return rid

    def abort(self, request_id: str) -> bool:
        """Aborts a request (all its samples), freeing its pages; False if unknown or finished."""
        self._held.pop(request_id, None)
        found = False
        for sid in self._samples.pop(request_id, ()):
            self._tracked.pop(sid, None)
            if sid in self.scheduler.requests:
                self.scheduler.finish_request(sid, RequestStatus.FINISHED_ABORTED, self.clock())
                found = True
        return found

    def has_unfinished(self) -> bool:
        """Whether any request is still queued or running."""
        return self.scheduler.has_unfinished()

    def has_work(self) -> bool:
        """Unfinished requests or host copies still in flight."""
        return self.scheduler.has_work()

    # ---- stepping ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Runs one `EngineCore` step; returns outputs of requests that got tokens."""
        out = self.core.step()
        if out is None:
            return []
        logprobs = out.executor_output.logprobs
        outputs = []
        for ev in out.events:
            tracked = self._tracked.get(ev.request_id)
            if tracked is None:
                continue
            if tracked.logprobs is not None:
                tracked.logprobs.append(logprobs[ev.request_id])
            self.num_generated_tokens += len(ev.new_token_ids)
            outputs.append(self._output(tracked))
        self._release_held()
        return outputs

    def _release_held(self) -> None:
        """Queues the held samples of requests whose sample 0 has its prompt computed (or
        has finished): its full prompt pages are in the prefix cache now."""
        for rid in [r for r in self._held if r in self._samples]:
            first = self._tracked.get(f"0_{rid}")  # None once it has finished
            if first is not None and first.request.num_computed_tokens < len(
                first.request.prompt_token_ids
            ):
                continue
            for held in self._held.pop(rid):
                if held.request_id in self._tracked:
                    self.scheduler.add_request(held)

    def _output(self, sample: SampleState) -> RequestOutput:
        req = sample.request
        finished = req.status.finished
        if sample.advance_text(finished) and not finished:  # a stop string ended it
            self.scheduler.finish_request(
                req.request_id, RequestStatus.FINISHED_STOPPED, self.clock()
            )
            finished = True
        last = True
        if finished:
            self._tracked.pop(req.request_id, None)
            samples = self._samples.get(sample.parent, [])
            if req.request_id in samples:
                samples.remove(req.request_id)
            last = not samples
            if last:
                self._samples.pop(sample.parent, None)
                self._held.pop(sample.parent, None)
        return sample.emit(finished, last)

    def generate(
        self, prompts: Sequence[str | Sequence[int]], params: SamplingParams | None = None
    ) -> list[RequestOutput]:
        """Runs ``prompts`` to completion (batched); returns final outputs in prompt order
        (with ``n > 1``, each prompt's samples in index order)."""
        ids = [self.add_request(p, params) for p in prompts]
        final: dict[tuple[str, int], RequestOutput] = {}
        while self.has_work():
            for out in self.step():
                if out.finished:
                    final[out.request_id, out.index] = out
        order = {rid: i for i, rid in enumerate(ids)}
        return [final[key] for key in sorted(final, key=lambda k: (order[k[0]], k[1]))]

    def stats(self) -> dict[str, float]:
        """Queue lengths, free pages, preemptions, prefix-cache counters, generated tokens and
        steps: a snapshot for summaries (the ``replay`` command's ``engine`` entry). The
        server's /metrics is `serve_jax.prom_metrics`, which keeps its own counters."""
        s = dict(self.scheduler.stats())
        s["generated_tokens"] = self.num_generated_tokens
        s["offload_preemptions"] = self.scheduler.num_offload_preemptions
        s["steps"] = self.num_steps
        return s


def _make_mesh(spec: str | None):
    """The executor's mesh from a spec like ``model=2`` over the first devices (None: none)."""
    if not spec:
        return None
    try:
        sizes = [int(part.split("=", 1)[1]) for part in spec.split(",")]
    except (IndexError, ValueError):
        raise ValueError(f"executor.mesh: bad mesh spec {spec!r} (want e.g. 'model=2')") from None
    if any(x < 0 for x in sizes):  # "-1" takes every device
        return make_mesh(spec)
    n = 1
    for size in sizes:
        n *= size
    if n > jax.device_count():
        raise ValueError(f"executor.mesh {spec!r} needs {n} devices, {jax.device_count()} seen")
    return make_mesh(spec, devices=jax.devices()[:n])
