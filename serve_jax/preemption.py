"""Preemption policies: four baselines faithful to the systems they name, and ``predictive``.

All policies implement `serve_jax.scheduler.VictimPolicy`: when the running requests need more
device blocks than are free, the scheduler hands them a `SchedulerView` and applies the
``(request, PreemptMode)`` pairs they return. The scheduler's rules are the same for every
policy (vLLM V1's: no admission in a step that preempted, a step's victims sit it out,
automatic prefix caching); a policy differs only in its victims, their mode and its admission
hook.

- ``fcfs_last`` (vLLM V1, `serve_jax.scheduler.FcfsLastPolicy`): the most recently admitted
  running request, by recompute; the scheduler asks again while blocks are short.
- ``fcfs_last_offload``: the same victim order, each victim offloaded to the host tier (recompute
  when the host pool is full).
- ``fewest_output`` (SGLang's retract, `FewestOutputPolicy`): victims from
  ``ScheduleBatch.retract_decode``: running requests sorted by (output tokens descending, prompt
  tokens ascending); pop from the back (fewest output tokens, longest prompt on ties) until the
  shortfall is covered *and* the blocks left over give every remaining request
  ``retract_decode_steps`` (20) more tokens; always keep one. Recompute. Admission follows
  SGLang's ``PrefillAdder``: each running request reserves ``new_token_ratio`` of its remaining
  ``max_tokens`` (clipped at 4096), a new one its prompt plus its clipped ``max_tokens``; the
  ratio starts at 0.7, decays to 0.098 over 600 steps, and a retraction resets it to the
  decoded fraction of the survivors' budgets (SGLang's defence against cascades).
- ``least_computed``: fewest computed tokens first (the cheapest to recompute), latest admission
  on ties, until the shortfall is covered. Recompute.
- ``predictive`` (ours): an online remaining-length predictor (`serve_jax.predictor`) gives each
  request a predicted remaining length ``r``. The running set's *predicted peak demand* is
  ``max_h sum_{i: r_i >= h} (c_i + h)`` tokens (``c_i`` its tokens now; requests that finish free
  their memory). Victims are taken in order of longest predicted remaining length (they hold and
  grow memory longest; a delay spreads over many tokens of their TPOT) until the shortfall is
  covered and the predicted peak of the requests left fits the device: the memory freed lasts
  until the predicted horizon. Each victim is offloaded or recomputed, whichever costs less:
  recompute = re-prefilling its computed tokens; offload = the restore on the critical path plus
  the part of the offload that does not overlap the next step's compute.
  The same peak-demand test gates admission (`PredictiveAdmission`): a waiting or offloaded
  request joins only when the predicted peak with it fits, so a victim is not re-admitted into
  the memory that was just freed for the others (the cascade of the baselines).

The gates are `PredictivePolicy.admission_limit` and `FewestOutputPolicy.admission_limit`, the
scheduler's admission hook (see `serve_jax.scheduler`); the other policies keep the hook's
default (no limit). Ablations of ``predictive`` switch one part off at a time:
``predictive_nogate`` (no admission gate), ``predictive_recompute`` (no offload).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from serve_jax.interface import (
    FcfsLastPolicy,
    PreemptMode,
    Request,
    RequestStatus,
    SchedulerView,
    VictimPolicy,
)
from serve_jax.predictor import PredictionLog, RemainingLengthPredictor, predicted_peak_tokens

if TYPE_CHECKING:
    from serve_jax.scheduler import Scheduler

__all__ = [
    "FcfsLastPolicy",
    "FewestOutputPolicy",
    "LeastComputedPolicy",
    "PredictivePolicy",
    "POLICY_NAMES",
    "ABLATIONS",
    "get_policy",
    "make_policy",
    "predicted_peak_tokens",
]

POLICY_NAMES = (
    "fcfs_last",
    "fcfs_last_offload",
    "fewest_output",
    "least_computed",
    "predictive",
)
"""The policies `simulate` compares by default: the baselines, then ours."""
ABLATIONS = ("predictive_nogate", "predictive_recompute")
"""``predictive`` with its admission gate, or its offload, switched off."""


class FewestOutputPolicy(VictimPolicy):
    """SGLang's retract: fewest output tokens first (longest prompt on ties), with a buffer, and
    SGLang's ``new_token_ratio`` admission throttle.

    Args:
      retract_decode_steps: after retracting, the free blocks must give each remaining request
        this many more tokens (SGLang's ``global_config.retract_decode_steps``, 20).
      init_new_token_ratio: the ratio's start and ceiling of its decay (SGLang 0.7).
      min_new_token_ratio_factor: the ratio's floor is this times the start (SGLang 0.14).
      new_token_ratio_decay_steps: steps to decay from start to floor (SGLang 600).
      clip_max_new_tokens: a request's remaining budget is clipped here (SGLang 4096).
      throttle: apply the admission throttle (False: SGLang's victims only, for ablations).
    """

    name = "fewest_output"

    def __init__(
        self,
        retract_decode_steps: int = 20,
        *,
        init_new_token_ratio: float = 0.7,
        min_new_token_ratio_factor: float = 0.14,
        new_token_ratio_decay_steps: int = 600,
        clip_max_new_tokens: int = 4096,
        throttle: bool = True,
    ):
        if retract_decode_steps < 0:
            raise ValueError(f"retract_decode_steps must be >= 0, got {retract_decode_steps}")
        if not 0.0 < init_new_token_ratio <= 1.0 or new_token_ratio_decay_steps < 1:
            raise ValueError("init_new_token_ratio must be in (0, 1], decay steps >= 1")
        self.retract_decode_steps = retract_decode_steps
        self.init_new_token_ratio = init_new_token_ratio
        self.min_new_token_ratio = init_new_token_ratio * min_new_token_ratio_factor
        self.new_token_ratio_decay = (
            init_new_token_ratio - self.min_new_token_ratio
        ) / new_token_ratio_decay_steps
        self.clip_max_new_tokens = clip_max_new_tokens
        self.throttle = throttle
        self.new_token_ratio = init_new_token_ratio
        self._retracted = False

    def admission_limit(self, sched: Scheduler) -> int | None:
        """SGLang's ``PrefillAdder`` budget: how many queued requests fit the free tokens left
        after every running request's ``new_token_ratio`` share of its remaining budget."""
        # SGLang's event loop: the ratio decays on every step that did not retract.
        if self._retracted:
            self._retracted = False
        else:
            self.new_token_ratio = max(
                self.new_token_ratio - self.new_token_ratio_decay, self.min_new_token_ratio
            )
        if not self.throttle:
            return None
        clip = self.clip_max_new_tokens
        bs = sched.block_size
        rem = (sched.blocks.device.num_free + sched.blocks.device.num_in_flight) * bs
        for r in sched.running:
            rem -= min(r.max_tokens - r.num_output_tokens, clip) * self.new_token_ratio
        allowed = 0
        for req in _chain(sched.offloaded, sched.waiting):
            total = req.num_tokens - req.num_computed_tokens
            total += min(req.max_tokens - req.num_output_tokens, clip)
            if total > rem:
                break
            rem -= total
            allowed += 1
        return allowed

    def select_victims(self, view: SchedulerView) -> list[tuple[Request, PreemptMode]]:
        # SGLang sorts (len(output_ids), -len(origin_input_ids)) descending and pops the back.
        order = sorted(
            view.running,
            key=lambda r: (r.num_output_tokens, -r.num_prompt_tokens),
            reverse=True,
        )
        victims: list[tuple[Request, PreemptMode]] = []
        freed = 0
        while len(order) > 1:
            spare_tokens = (freed - view.blocks_needed) * view.block_size
            if victims and spare_tokens >= len(order) * self.retract_decode_steps:
                break
            req = order.pop()
            victims.append((req, PreemptMode.RECOMPUTE))
            freed += view.device_blocks_held.get(req.request_id, 0)
        if victims:
            # retract_decode's new estimate, over the requests that stay.
            decoded = sum(r.num_output_tokens for r in order)
            budget = sum(r.max_tokens for r in order)
            steps = self.retract_decode_steps * len(order)
            self.new_token_ratio = min(1.0, (decoded + steps) / budget) if budget else 1.0
            self._retracted = True
        return victims


class LeastComputedPolicy(VictimPolicy):
    """Fewest computed tokens first (cheapest recompute), latest admission on ties."""

    name = "least_computed"

    def select_victims(self, view: SchedulerView) -> list[tuple[Request, PreemptMode]]:
        order = sorted(view.running, key=lambda r: (r.num_computed_tokens, -r.admission_seq))
        victims: list[tuple[Request, PreemptMode]] = []
        freed = 0
        for req in order:
            if freed >= view.blocks_needed:
                break
            victims.append((req, PreemptMode.RECOMPUTE))
            freed += view.device_blocks_held.get(req.request_id, 0)
        return victims


class _PredState:
    """Per-request predictor state kept in ``Request.predictor_state``."""

    __slots__ = ("generated_at_refresh", "remaining_at_refresh", "gate_at_refresh")

    def __init__(self) -> None:
        self.generated_at_refresh = -1
        self.remaining_at_refresh = 0.0
        self.gate_at_refresh = 0.0


class PredictivePolicy(VictimPolicy):
    """Predictor-driven, memory-aware victims and admission; per-victim offload or recompute.

    Args:
      predictor: the online remaining-length predictor (a fresh one by default: cold start).
      gate_quantile: quantile of the remaining length used for the admission test (higher is
        more conservative: fewer preemptions, smaller batches).
      headroom: fraction of the device blocks kept free in the admission test.
      refresh_tokens: the prediction is re-conditioned on the tokens generated every this many
        tokens, and counted down by one in between.
      allow_offload: consider offload (else recompute only).
      gate: gate admission (False leaves only victim selection, for ablations).
      record_every: predictions are logged for error reports every this many tokens.
      cheap_preemption_steps: admit past the gate a request whose later recompute would cost at
        most this many decode steps (0: never; a cost-aware gate for cheap-recompute regimes).
    """

    name = "predictive"

    def __init__(
        self,
        predictor: RemainingLengthPredictor | None = None,
        *,
        gate_quantile: float = 0.7,
        headroom: float = 0.0,
        refresh_tokens: int = 16,
        allow_offload: bool = True,
        gate: bool = True,
        record_every: int = 64,
        cheap_preemption_steps: float = 0.0,
    ):
        if not 0.0 < gate_quantile < 1.0:
            raise ValueError(f"gate_quantile must be in (0, 1), got {gate_quantile}")
        if not 0.0 <= headroom < 1.0:
            raise ValueError(f"headroom must be in [0, 1), got {headroom}")
        if cheap_preemption_steps < 0:
            raise ValueError(f"cheap_preemption_steps must be >= 0, got {cheap_preemption_steps}")
        self.cheap_preemption_steps = cheap_preemption_steps
        if refresh_tokens < 1:
            raise ValueError(f"refresh_tokens must be >= 1, got {refresh_tokens}")
        self.predictor = predictor or RemainingLengthPredictor()
        self.gate_quantile = gate_quantile
        self.headroom = headroom
        self.refresh_tokens = refresh_tokens
        self.allow_offload = allow_offload
        self.gate = gate
        self.log = PredictionLog(self.predictor, record_every=record_every)
        self.on_tokens_every = record_every  # the log's grid: no other token needs a call
        self._total_blocks: int | None = None
        self._block_size = 16
        # The last gate answer and the state it was for (see `admission_limit_ahead`).
        self._last_gate: tuple[tuple[int, ...], int] | None = None
        if not gate:
            self.name = "predictive_nogate"
        elif not allow_offload:
            self.name = "predictive_recompute"

    # -- predictor bookkeeping ---------------------------------------------------------------

    def _fresh_state(self, req: Request, g: int) -> _PredState:
        """``req``'s predictor state at ``g`` output tokens, re-conditioned on ``g`` when it is
        new or ``refresh_tokens`` old."""
        st = req.predictor_state
        if not isinstance(st, _PredState):
            st = _PredState()
            req.predictor_state = st
        if st.generated_at_refresh < 0 or g - st.generated_at_refresh >= self.refresh_tokens:
            mean, gate = self.predictor.mean_and_quantile(
                len(req.prompt_token_ids), g, self.gate_quantile
            )
            st.generated_at_refresh = g
            st.remaining_at_refresh = mean
            st.gate_at_refresh = gate
        return st

    def remaining(self, req: Request) -> tuple[float, float]:
        """(mean, gate-quantile) predicted remaining output tokens of ``req``."""
        g = len(req.output_token_ids)
        st = self._fresh_state(req, g)
        done = g - st.generated_at_refresh
        return max(st.remaining_at_refresh - done, 1.0), max(st.gate_at_refresh - done, 1.0)

    def on_admitted(self, req: Request, now: float) -> None:
        self.log.maybe_record(req.request_id, req.num_prompt_tokens, req.num_output_tokens)

    def on_tokens(self, req: Request, now: float, num_new: int = 1) -> None:
        # Every grid point of the log the new tokens reached (after a run of several, the
        # predictor has not changed since: nothing finished).
        n = len(req.output_token_ids)
        every = self.log.record_every
        for g in range(((n - num_new) // every + 1) * every, n + 1, every):
            self.log.maybe_record(req.request_id, req.num_prompt_tokens, g)

    def on_finished(self, req: Request, now: float) -> None:
        if req.status in (RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_STOPPED):
            self.predictor.observe(req.num_prompt_tokens, req.num_output_tokens)
            self.log.finish(req.request_id, req.num_output_tokens)
        else:
            self.log.finish(req.request_id, -1)  # aborted: nothing to score

    # -- victims -----------------------------------------------------------------------------

    def _mode(self, view: SchedulerView, req: Request, held: int, host_left: int) -> PreemptMode:
        if not self.allow_offload or held == 0 or held > host_left or req.num_computed_tokens == 0:
            return PreemptMode.RECOMPUTE
        costs = view.costs
        recompute = costs.prefill_seconds(req.num_computed_tokens)
        context = sum(r.num_tokens for r in view.running)
        step = costs.decode_seconds(len(view.running), context)
        transfer = costs.transfer_seconds(held)
        # The offload runs behind the next step's compute; the restore sits before a step.
        offload = max(transfer - step, 0.0) + transfer
        return PreemptMode.OFFLOAD if offload < recompute else PreemptMode.RECOMPUTE

    def select_victims(self, view: SchedulerView) -> list[tuple[Request, PreemptMode]]:
        if not view.running:
            return []
        capacity = self._capacity_tokens(view)
        rem = {r.request_id: self.remaining(r)[0] for r in view.running}
        # Longest predicted remaining first; fewer computed tokens (cheaper) on ties.
        order = sorted(
            view.running, key=lambda r: (-rem[r.request_id], r.num_computed_tokens, r.request_id)
        )
        keep = {r.request_id: r for r in view.running}
        victims: list[tuple[Request, PreemptMode]] = []
        freed = 0
        host_left = view.free_host_blocks
        for req in order:
            if len(keep) <= 1:
                break
            if freed >= view.blocks_needed:
                items = [(float(r.num_tokens), rem[r.request_id]) for r in keep.values()]
                if predicted_peak_tokens(items) <= capacity:
                    break
            held = view.device_blocks_held.get(req.request_id, 0)
            mode = self._mode(view, req, held, host_left)
            if mode == PreemptMode.OFFLOAD:
                host_left -= held
            victims.append((req, mode))
            freed += held
            del keep[req.request_id]
        return victims

    # -- admission ---------------------------------------------------------------------------

    def attach(self, sched: Scheduler) -> None:
        """Learns the device pool size (called by the `Scheduler` at construction)."""
        self._total_blocks = sched.blocks.device.num_blocks
        self._block_size = sched.block_size
        self._last_gate = None  # (a new scheduler's states)

    def _capacity_tokens(self, view: SchedulerView | None = None) -> float:
        total = self._total_blocks
        if total is None:
            if view is None:
                raise RuntimeError("PredictivePolicy: attach() it to a scheduler first")
            # Not attached to a scheduler (a bare view): what the running set holds plus what
            # is free.
            total = view.free_device_blocks + sum(view.device_blocks_held.values())
        bs = view.block_size if view is not None else self._block_size
        return total * bs * (1.0 - self.headroom)

    def admission_limit(self, sched: Scheduler) -> int:
        """How many requests at the head of [offloaded..., waiting...] may be admitted now."""
        if not sched.waiting and not sched.offloaded:
            return 0  # (nothing queued: the simulator's decode runs ask at every step)
        return self.admission_limit_ahead(sched, 0, sched.blocks.device.num_free)

    def admission_limit_ahead(self, sched: Scheduler, steps: int, free_blocks: int) -> int:
        """`admission_limit` after ``steps`` more tokens of every running request, with
        ``free_blocks`` free device blocks (see `VictimPolicy.admission_limit_ahead`): the
        running requests' predictions are re-conditioned as they would be then.

        The simulator asks twice about the step it is about to run (once to see whether it
        can skip it in a run, once from `Scheduler.schedule`); the second answer is the first
        one, kept with the state it was for (the step, the free blocks and the number of
        requests in each queue): a scheduler's requests only move in its steps, and asking
        again at the same state would re-condition nothing.
        """
        queued = len(sched.offloaded) + len(sched.waiting)
        if not self.gate or queued == 0:
            return queued
        head = sched.offloaded[0] if sched.offloaded else sched.waiting[0]
        if sched.blocks.num_blocks_for(head.num_tokens) > free_blocks:
            # Not even the head's KV fits what is free now; nothing can be admitted this step
            # (and nothing may take the blocks a preemption frees in it).
            return 0
        state = (
            sched.step_count + steps,
            free_blocks,
            len(sched.requests),
            len(sched.running),
            queued,
        )
        last = self._last_gate
        if last is not None and last[0] == state:
            return last[1]
        if self._total_blocks is None:
            self.attach(sched)
        capacity = self._capacity_tokens()
        bs = sched.block_size
        items = []
        fresh = self._fresh_state
        for r in sched.running:
            # (`remaining`'s gate quantile, inlined: every running request, every gated step)
            g = len(r.output_token_ids) + steps
            st = fresh(r, g)
            q = st.gate_at_refresh - (g - st.generated_at_refresh)
            # + one block of rounding slack
            items.append((float(len(r.prompt_token_ids) + g + bs), 1.0 if 1.0 > q else q))
        allowed = 0
        for req in _chain(sched.offloaded, sched.waiting):
            _, q = self.remaining(req)
            trial = items + [(float(req.num_tokens + bs), q)]
            if items and predicted_peak_tokens(trial) > capacity:
                if not self._cheap_to_preempt(sched, req, q, items):
                    break
            items = trial
            allowed += 1
            if len(items) >= sched.max_num_seqs:
                break
        self._last_gate = (state, allowed)
        return allowed

    def _cheap_to_preempt(self, sched: Scheduler, req: Request, q: float, items) -> bool:
        """Whether preempting ``req`` later would cost at most ``cheap_preemption_steps`` steps.

        The cost is recomputing the context it would hold at its predicted end; where that is
        about a step (tiny contexts, fixed-cost steps), a gate that shrinks batches to avoid it
        costs more throughput than the preemption it avoids.
        """
        if self.cheap_preemption_steps <= 0:
            return False
        ctx = int(req.num_tokens + q)
        held = int(sum(c for c, _ in items))
        step = sched.costs.decode_seconds(len(items) + 1, held + req.num_tokens)
        return sched.costs.prefill_seconds(ctx) <= self.cheap_preemption_steps * step


def _chain(*queues):
    for q in queues:
        yield from q


def make_policy(
    name: str, gate_quantile: float | None = None, cheap_preemption_steps: float | None = None
) -> VictimPolicy:
    """`get_policy` with the command-line options of ``predictive`` (None: its default); the
    options apply to the ``predictive`` policies only.

    Raises:
      ValueError: an unknown name or a bad option.
    """
    kw: dict[str, Any] = {}
    if name.strip().lower().startswith("predictive"):
        if gate_quantile is not None:
            kw["gate_quantile"] = gate_quantile
        if cheap_preemption_steps is not None:
            kw["cheap_preemption_steps"] = cheap_preemption_steps
    return get_policy(name, **kw)


def get_policy(name: str, **kwargs: Any) -> VictimPolicy:
    """A fresh policy by name.

    Args:
      name: one of `POLICY_NAMES` or `ABLATIONS`.
      **kwargs: passed to the policy's constructor.

    Raises:
      ValueError: an unknown name.
    """
    key = name.strip().lower()
    if key == "fcfs_last":
        return FcfsLastPolicy(**kwargs)
    if key == "fcfs_last_offload":
        return FcfsLastPolicy(PreemptMode.OFFLOAD, **kwargs)
    if key == "fewest_output":
        return FewestOutputPolicy(**kwargs)
    if key == "least_computed":
        return LeastComputedPolicy(**kwargs)
    if key == "predictive":
        return PredictivePolicy(**kwargs)
    if key == "predictive_nogate":
        return PredictivePolicy(gate=False, **kwargs)
    if key == "predictive_recompute":
        return PredictivePolicy(allow_offload=False, **kwargs)
    raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICY_NAMES + ABLATIONS)}")
