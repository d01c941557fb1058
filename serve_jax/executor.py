"""The JAX executor: runs a `SchedulerOutput` on the model with paged KV pools and a host tier.

One ``execute`` call, in order:

1. restores: host pages back into the device pools (needed by this step's compute);
2. compute: the prefill chunks, then the decodes, each as one jitted step over a padded batch
   (batch, chunk length and block-table width are rounded up to powers of two so a handful of
   shapes are compiled). The step writes the new K/V into the pages, runs ragged paged
   attention, samples a token per sequence on device, and donates the pools. A batch with a
   request that needs more than temperature and top-p (penalties, top-k, min-p, min_tokens,
   logprobs) runs the step without sampling, then `serve_jax.sampling.sample_full`, jitted
   apart;
3. offloads issued in the *previous* step are waited for (they ran alongside this step's
   compute) and reported complete; this step's offloads are issued (asynchronous device_put to
   ``pinned_host``) so they overlap the next step;
4. sampled tokens are fetched to the host.

The executor keeps no per-request state: token ids, positions and block tables all come in the
`SchedulerOutput` (the same contract as the simulator's executor).
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

import tapas_jax
from serve_jax.attention import context_attention
from serve_jax.interface import TokenLogprobs
from serve_jax.kv_cache import PagedKVView, make_kv_pools
from serve_jax.model import Decoder
from serve_jax.offload import HostKVTier
from serve_jax.sampling import (
    SequenceSampling,
    full_sampler_arrays,
    sample_full,
    sample_tokens,
)
from serve_jax.scheduler import ExecutorOutput, ScheduledChunk, SchedulerOutput
from tapas_jax.hardware import profile_for_device

__all__ = ["JaxExecutor", "pad_pow2"]


def _sequence(chunk: ScheduledChunk) -> SequenceSampling | None:
    """A chunk's opaque ``sampling``: the engine's `SequenceSampling` (parameters and token
    history, one sampling path for every parameter), or None for greedy.

    Raises:
      TypeError: anything else, a bare `SamplingParams` included (it has no token history
        for penalties, so it could not take the full sampler).
    """
    s = chunk.sampling
    if s is None or isinstance(s, SequenceSampling):
        return s
    raise TypeError(
        f"request {chunk.request_id!r}: chunk sampling must be a SequenceSampling (parameters "
        f"with the token history) or None for greedy, got {type(s).__name__}"
    )


def plan_decoder(
    model: Decoder,
    mesh,
    memory_limit_bytes: float | None = None,
    batch: int = 8,
    seq: int = 64,
    hardware: str | None = None,
):
    """A `tapas_jax.plan` of the decoder's forward (no cache) on ``mesh``: weight shardings.

    The planner sees a plain causal forward of ``[batch, seq]`` tokens; the paged step then
    runs with the weights placed by the plan and GSPMD propagates the rest.
    """
    graphdef, params = nnx.split(model)

    class _NoCache:
        def __init__(self, positions):
            self.positions = positions

        def attend(self, layer, q, k, v):
            return context_attention(q, k, v, self.positions)

    def forward(params, tokens):
        m = nnx.merge(graphdef, params)
        b, t = tokens.shape
        pos = jnp.broadcast_to(jnp.arange(t)[None], (b, t))
        return m(tokens, pos, _NoCache(pos))

    if hardware is None:
        platform = jax.default_backend()
        # On CPU (tests on simulated devices) plan as for the default TPU, so that the CPU tests
        # check the plan a TPU would get; on an accelerator, plan for the chip it is.
        kind = "" if platform == "cpu" else jax.devices()[0].device_kind
        hardware = profile_for_device("tpu" if platform == "cpu" else platform, kind).name
    return tapas_jax.plan(
        forward,
        params,
        jax.ShapeDtypeStruct((batch, seq), jnp.int32),
        mesh=mesh,
        hardware=hardware,
        memory_limit_bytes=memory_limit_bytes,
    )


def _pow2_range(lo: int, hi: int) -> list[int]:
    out, x = [], 1
    while x < hi:
        if x >= lo:
            out.append(x)
        x *= 2
    return [*out, hi] if hi >= lo else out


def pad_pow2(n: int, minimum: int = 1) -> int:
    """Smallest power of two >= max(n, minimum)."""
    n = max(n, minimum)
    return 1 << (n - 1).bit_length()


def _last_logits(model, k_pool, v_pool, tokens, positions, valid, tables, last):
    """Writes the batch's K/V pages, attends, returns the logits after each row's last token."""
    view = PagedKVView(k_pool, v_pool, tables, positions, valid)
    h = model.hidden(tokens, positions, view)
    h_last = jnp.take_along_axis(h, last[:, None, None], axis=1)[:, 0]
    return model.logits(h_last), view.k_pool, view.v_pool


def _paged_step(
    graphdef, params, k_pool, v_pool, tokens, positions, valid, tables, last, *sampling
):
    """One forward over a padded batch: write K/V pages, attend, sample a token per row.

    ``sampling`` is ``(temperature, top_p, seeds, counters)``; returns
    ``(next_tokens, k_pool, v_pool)``.
    """
    model = nnx.merge(graphdef, params)
    logits, k_pool, v_pool = _last_logits(
        model, k_pool, v_pool, tokens, positions, valid, tables, last
    )
    return sample_tokens(logits, *sampling), k_pool, v_pool


@functools.cache
def flat_paged_step(graphdef, treedef):
    """The jitted paged step, taking the weights as a flat list (``jax.tree.leaves(params)``).

    ``step(leaves, k_pool, v_pool, tokens, positions, valid, tables, last, temperature, top_p,
    seeds, counters) -> (next_tokens, k_pool, v_pool)``; the pools are donated. ``graphdef`` is
    bound here and hashed once: a list of arrays is the cheapest argument for jit's dispatch
    path, where an `nnx.State` would be flattened and a `GraphDef` static argument hashed on
    every call (about 5 ms per step for the `small` preset on a CPU). Cached per architecture,
    so engines serving the same one share compilations.
    """

    def step(leaves, k_pool, v_pool, *arrays):
        return _paged_step(graphdef, jax.tree.unflatten(treedef, leaves), k_pool, v_pool, *arrays)

    return jax.jit(step, donate_argnums=(1, 2))


@functools.cache
def flat_paged_logits(graphdef, treedef):
    """The paged step without sampling, for batches that take the full sampler:
    ``(leaves, k_pool, v_pool, tokens, positions, valid, tables, last) -> (logits, k_pool,
    v_pool)``. The sampler (`sample_full`) is jitted apart, so its shapes (history width,
    banned ids) recompile only the sampler, never the model."""

    def step(leaves, k_pool, v_pool, *arrays):
        model = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
        return _last_logits(model, k_pool, v_pool, *arrays)

    return jax.jit(step, donate_argnums=(1, 2))


_jit_sample_full = jax.jit(sample_full)


class JaxExecutor:
    """Paged-KV model runner implementing the scheduler's `Executor` protocol.

    Args:
      model: the decoder (its weights are split out and passed to the jitted step).
      num_device_blocks: pages in each device pool.
      block_size: tokens per page.
      use_host_tier: keep a host tier for offload (needs a host memory kind on the device).
      device: where pools and weights live (default: the first device); ignored with a mesh.
      mesh: a mesh from `tapas_jax.mesh`; with a ``model`` axis > 1 the weights' shardings come
        from a `tapas_jax.plan` of the model's forward, and the pools are split over KV heads
        when the axis divides them (replicated otherwise).
      plan_memory_limit_bytes: per-device memory budget handed to the planner.
      min_batch: smallest padded decode batch (raise it to compile fewer shapes).
      prefill_rows: rows per prefill call (chunks beyond it go in further calls); 0 puts
        all prefill chunks of a step in one call padded to a power of two.
      min_chunk: smallest padded prefill chunk length.
      min_table_blocks: smallest padded block-table width.
    """

    def __init__(
        self,
        model: Decoder,
        num_device_blocks: int,
        block_size: int,
        use_host_tier: bool = True,
        device=None,
        min_batch: int = 1,
        prefill_rows: int = 0,
        min_chunk: int = 1,
        min_table_blocks: int = 1,
        mesh=None,
        plan_memory_limit_bytes: float | None = None,
    ):
        self.min_batch, self.min_chunk = min_batch, min_chunk
        self.prefill_rows = prefill_rows
        self.min_table_blocks = min_table_blocks
        self.cfg = model.cfg
        self.max_table_blocks = -(-self.cfg.max_seq_len // block_size)
        self.block_size = block_size
        self.num_device_blocks = num_device_blocks
        self.device = device or jax.devices()[0]
        self.mesh = mesh
        self.plan = None
        graphdef, params = nnx.split(model)
        self.graphdef = graphdef
        if mesh is None:
            self._replicated = SingleDeviceSharding(self.device)
            pool_sharding = self._replicated
            param_shardings = self._replicated
        else:
            self._replicated = NamedSharding(mesh, PartitionSpec())
            tp = dict(mesh.shape).get("model", 1)
            if tp > 1:
                self.plan = plan_decoder(model, mesh, memory_limit_bytes=plan_memory_limit_bytes)
                param_shardings = self.plan.in_shardings_on(mesh)[0]
            else:
                param_shardings = self._replicated
            kv_spec = "model" if tp > 1 and self.cfg.n_kv_heads % tp == 0 else None
            pool_sharding = NamedSharding(mesh, PartitionSpec(None, kv_spec, None, None))
        self.params = jax.device_put(params, param_shardings)
        leaves, treedef = jax.tree.flatten(self.params)
        self._leaves = leaves
        self._step = flat_paged_step(graphdef, treedef)
        self._logits_step = flat_paged_logits(graphdef, treedef)
        self.pool_sharding = pool_sharding
        self.k_pool, self.v_pool = make_kv_pools(
            self.cfg, num_device_blocks, block_size, sharding=pool_sharding
        )
        self.host = HostKVTier(self.device, sharding=pool_sharding) if use_host_tier else None
        self.num_steps = 0

    # ---- batches -------------------------------------------------------------------------
    def _arrays(
        self,
        chunks: list[ScheduledChunk],
        rows: list[SequenceSampling | None],
        tables: dict[str, list[int]],
    ):
        longest = max(c.num_tokens for c in chunks)
        if longest > 1 and self.prefill_rows:
            b = self.prefill_rows
        else:
            b = pad_pow2(len(chunks), self.min_batch)
        t = 1 if longest == 1 else pad_pow2(longest, self.min_chunk)
        m = pad_pow2(max(len(tables[c.request_id]) for c in chunks), self.min_table_blocks)
        tokens = np.zeros((b, t), np.int32)
        positions = np.zeros((b, t), np.int32)
        valid = np.zeros((b, t), bool)
        table_arr = np.zeros((b, m), np.int32)
        last = np.zeros((b,), np.int32)
        temp = np.zeros((b,), np.float32)
        top_p = np.ones((b,), np.float32)
        seed = np.zeros((b,), np.int32)
        ctr = np.zeros((b,), np.int32)
        for i, (c, seq) in enumerate(zip(chunks, rows, strict=True)):
            n = c.num_tokens
            tokens[i, :n] = c.token_ids
            positions[i, :n] = np.arange(c.start, c.start + n)
            valid[i, :n] = True
            table = tables[c.request_id]
            table_arr[i, : len(table)] = table
            last[i] = n - 1
            if seq is not None:
                sp = seq.params
                temp[i], top_p[i], seed[i] = sp.temperature, sp.top_p, sp.seed
            ctr[i] = c.num_output_tokens
        return tokens, positions, valid, table_arr, last, temp, top_p, seed, ctr

    def _dispatch(self, chunks, rows, tables):
        """Runs one padded batch (``rows``: each chunk's `_sequence`); returns its sampled
        tokens and logprobs (None unless the batch took the full sampler) on device."""
        arrays = list(self._arrays(chunks, rows, tables))
        if not any(r is not None and r.params.needs_full_sampler for r in rows):
            args = jax.device_put(arrays, self._replicated)
            toks, self.k_pool, self.v_pool = self._step(
                self._leaves, self.k_pool, self.v_pool, *args
            )
            return toks, None
        extras = full_sampler_arrays(
            [(r, c.num_output_tokens) for r, c in zip(rows, chunks, strict=True)],
            arrays[0].shape[0],
            self.cfg.vocab_size,
        )
        return self._sample_full(arrays, extras)

    def _sample_full(self, arrays, extras):
        args, extras = jax.device_put((arrays, extras), self._replicated)
        logits, self.k_pool, self.v_pool = self._logits_step(
            self._leaves, self.k_pool, self.v_pool, *args[:5]
        )
        return _jit_sample_full(logits, *args[5:], extras)

    def warmup(self, max_num_seqs: int, max_chunk: int, full_sampler: bool = True) -> int:
        """Compiles the step for the shapes serving will use; returns how many were run.

        Runs all-padding batches (every row invalid, so nothing is written to the pools):
        decodes at every padded batch size up to ``max_num_seqs`` and prefills at every
        padded chunk length up to ``max_chunk`` (one row per call when ``prefill_rows`` is set,
        else one row), each with every padded table width. With ``full_sampler`` each shape
        also runs through the full sampler's path (logits step, then `sample_full` without
        penalties), so the first request asking for logprobs, top-k, min-p or min_tokens
        compiles nothing; penalties compile only the sampler for their history width.
        """
        widths = sorted(
            {pad_pow2(w, self.min_table_blocks) for w in _pow2_range(1, self.max_table_blocks)}
        )
        batches = sorted({pad_pow2(b, self.min_batch) for b in _pow2_range(1, max_num_seqs)})
        chunks = sorted({pad_pow2(t, self.min_chunk) for t in _pow2_range(2, max_chunk)})
        shapes = [(b, 1, m) for b in batches for m in widths]
        rows = self.prefill_rows or 1
        shapes += [(rows, t, m) for t in chunks for m in widths]
        for b, t, m in shapes:
            z = np.zeros((b, t), np.int32)
            args = [
                z,
                z,
                np.zeros((b, t), bool),
                np.zeros((b, m), np.int32),
                np.zeros((b,), np.int32),
                np.zeros((b,), np.float32),
                np.ones((b,), np.float32),
                np.zeros((b,), np.int32),
                np.zeros((b,), np.int32),
            ]
            toks, self.k_pool, self.v_pool = self._step(
                self._leaves, self.k_pool, self.v_pool, *jax.device_put(args, self._replicated)
            )
            toks.block_until_ready()
            if full_sampler:
                extras = full_sampler_arrays([], b, self.cfg.vocab_size)
                toks, _ = self._sample_full(args, extras)
                toks.block_until_ready()
        return len(shapes)

    # ---- protocol ------------------------------------------------------------------------
    def execute(self, scheduler_output: SchedulerOutput) -> ExecutorOutput:
        """Runs one step; see the module docstring for the order of operations."""
        so = scheduler_output
        t0 = time.perf_counter()
        if so.restores:
            if self.host is None:
                raise RuntimeError("restore requested but the executor has no host tier")
            self.k_pool, self.v_pool = self.host.restore(self.k_pool, self.v_pool, so.restores)
        pending = []
        rows = self.prefill_rows or max(1, len(so.prefills))
        groups = [so.prefills[i : i + rows] for i in range(0, len(so.prefills), rows)]
        for group in [*groups, so.decodes]:
            if group:
                seqs = [_sequence(c) for c in group]
                pending.append((group, seqs, self._dispatch(group, seqs, so.block_tables)))
        completed = self.host.complete() if self.host is not None else []
        if so.offloads:
            if self.host is None:
                raise RuntimeError("offload requested but the executor has no host tier")
            self.host.offload(self.k_pool, self.v_pool, so.offloads)
        sampled: dict[str, int] = {}
        logprobs: dict[str, TokenLogprobs] = {}
        for group, seqs, (toks, lps) in pending:
            toks = np.asarray(toks)
            wanted = [
                (i, c, seq.params.logprobs)
                for i, (c, seq) in enumerate(zip(group, seqs, strict=True))
                if c.sample and seq is not None and seq.params.logprobs is not None
            ]
            if wanted:
                token_lp, top_ids, top_lp = jax.device_get(lps)
            for i, c, k in wanted:
                logprobs[c.request_id] = TokenLogprobs(
                    float(token_lp[i]),
                    tuple(int(t) for t in top_ids[i, :k]),
                    tuple(float(x) for x in top_lp[i, :k]),
                )
            for i, c in enumerate(group):
                if c.sample:
                    sampled[c.request_id] = int(toks[i])
        self.num_steps += 1
        return ExecutorOutput(
            sampled=sampled,
            logprobs=logprobs,
            completed_offloads=completed,
            completed_restores=list(so.restores),
            step_seconds=time.perf_counter() - t0,
        )
