"""The data contract between the scheduler, its policies and the executors (pure Python).

`serve_jax.scheduler.Scheduler` plans steps over `Request` objects and hands a `SchedulerOutput`
to an `Executor` (the JAX one or the simulator's), which answers with an `ExecutorOutput`; the
scheduler then reports `RequestEvent` s. A `VictimPolicy` chooses preemption victims from a
`SchedulerView` and may gate admission (`VictimPolicy.admission_limit`); `CostHints` are the
predicted costs it may weigh. Nothing here imports JAX or reads a clock.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from serve_jax.scheduler import Scheduler

__all__ = [
    "RequestStatus",
    "PreemptMode",
    "Request",
    "CostHints",
    "LinearCostHints",
    "SchedulerView",
    "VictimPolicy",
    "FcfsLastPolicy",
    "ScheduledChunk",
    "SchedulerOutput",
    "ExecutorOutput",
    "TokenLogprobs",
    "Executor",
    "RequestEvent",
]


class RequestStatus(enum.Enum):
    """Where a request is in its life."""

    WAITING = "waiting"
    """Queued, never run (or nothing computed yet)."""
    RUNNING = "running"
    """Holds device blocks and gets tokens each step."""
    PREEMPTED = "preempted"
    """Preempted by recompute: back in the waiting queue, its KV to be recomputed."""
    OFFLOADED = "offloaded"
    """Preempted by offload: its pages are in host blocks, restored before it runs again."""
    FINISHED_STOPPED = "finished_stopped"
    """Ended on a stop token or stop string."""
    FINISHED_LENGTH = "finished_length"
    """Ended at max_tokens (or the context limit)."""
    FINISHED_ABORTED = "finished_aborted"
    """Aborted by the client or the engine."""

    @property
    def finished(self) -> bool:
        return self.value.startswith("finished")


class PreemptMode(enum.Enum):
    """How a victim gives back its device blocks."""

    RECOMPUTE = "recompute"
    OFFLOAD = "offload"


@dataclasses.dataclass(eq=False)
class Request:
    """One generation request as the scheduler sees it (no text, no tensors)."""

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    arrival_time: float
    stop_token_ids: frozenset[int] = frozenset()
    """Sampling one of these ends the request (FINISHED_STOPPED); the token is kept."""
    sampling: Any = None
    """Opaque sampling parameters, passed to the executor with each chunk."""
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    num_computed_tokens: int = 0
    """Tokens whose KV is in the cache (device, or host when offloaded)."""
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    admission_seq: int = -1
    """Increases with every admission to the running set (re-admissions get a new one)."""
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = dataclasses.field(default_factory=list)
    """When each output token was produced (``now`` of its update_from_output)."""
    preemption_times: list[float] = dataclasses.field(default_factory=list)
    resume_times: list[float] = dataclasses.field(default_factory=list)
    finish_time: float | None = None
    predictor_state: Any = None
    """Free for policies and predictors."""
    cache_salt: str | None = None
    """Extra key of the prefix cache's first block: only requests with the same salt share
    cached blocks (the simulator salts each multi-turn session, whose tokens are placeholders)."""

    def __post_init__(self):
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id!r}: empty prompt")
        if self.max_tokens < 1:
            raise ValueError(f"request {self.request_id!r}: max_tokens must be >= 1")

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens so far."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)


class CostHints:
    """Predicted costs a policy may weigh (the engine fits them; the simulator uses a roofline)."""

    def prefill_seconds(self, num_tokens: int) -> float:
        """Time to (re)compute the KV of ``num_tokens`` tokens."""
        raise NotImplementedError

    def transfer_seconds(self, num_blocks: int) -> float:
        """Time to copy ``num_blocks`` blocks one way over the host link."""
        raise NotImplementedError

    def decode_seconds(self, batch_size: int, context_tokens: int) -> float:
        """Time of one decode step of ``batch_size`` requests holding ``context_tokens`` in all."""
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class LinearCostHints(CostHints):
    """Affine costs: a fixed part plus a per-token (or per-block) part."""

    prefill_base: float = 1e-3
    prefill_per_token: float = 1e-5
    transfer_base: float = 1e-4
    transfer_per_block: float = 1e-5
    decode_base: float = 1e-3
    decode_per_seq: float = 1e-4
    decode_per_context_token: float = 1e-7

    def prefill_seconds(self, num_tokens: int) -> float:
        return self.prefill_base + self.prefill_per_token * num_tokens

    def transfer_seconds(self, num_blocks: int) -> float:
        return self.transfer_base + self.transfer_per_block * num_blocks

    def decode_seconds(self, batch_size: int, context_tokens: int) -> float:
        return (
            self.decode_base
            + self.decode_per_seq * batch_size
            + self.decode_per_context_token * context_tokens
        )


@dataclasses.dataclass(frozen=True)
class SchedulerView:
    """What a victim policy sees when the running set needs more device blocks than are free."""

    step: int
    now: float
    block_size: int
    free_device_blocks: int
    free_host_blocks: int
    blocks_needed: int
    """Shortfall: device blocks still missing for this step's running requests."""
    running: tuple[Request, ...]
    """Running requests in admission order (oldest first)."""
    waiting: tuple[Request, ...]
    offloaded: tuple[Request, ...]
    costs: CostHints
    device_blocks_held: dict[str, int] = dataclasses.field(default_factory=dict)
    """Device blocks held by each running request (what preempting it gives back)."""


class VictimPolicy:
    """Chooses which running requests to preempt, and how. Subclass and set ``name``."""

    name: str = "base"
    on_tokens_every: int = 1
    """`on_tokens` is called when a request's output count reaches a multiple of this (1: after
    every token); a policy that looks at every n-th token sets n and saves the other calls."""

    def select_victims(self, view: SchedulerView) -> list[tuple[Request, PreemptMode]]:
        """Returns victims (from ``view.running``) and a mode for each; [] to preempt nobody."""
        raise NotImplementedError

    def on_admitted(self, req: Request, now: float) -> None:
        """A request joined the running set (first time or after a preemption)."""

    def on_tokens(self, req: Request, now: float, num_new: int = 1) -> None:
        """A request's last ``num_new`` output tokens reached a multiple of ``on_tokens_every``
        (one token after each update_from_output; several after a run of quiet decode steps the
        simulator applies at once, `serve_jax.sim_runs`, during which nothing finished)."""

    def on_finished(self, req: Request, now: float) -> None:
        """A request finished or was aborted."""

    def attach(self, sched: Scheduler) -> None:
        """Called once by the scheduler that uses this policy (to learn its pool sizes)."""

    def admission_limit(self, sched: Scheduler) -> int | None:
        """The admission hook: how many requests at the head of ``[offloaded..., waiting...]``
        the scheduler may admit in the step it is planning (None: no limit, the default).

        A policy that returns a number gates admission; the scheduler then also holds the
        step's own victims out of that step (the limit was decided before they were requeued).
        """
        return None

    def admission_limit_ahead(self, sched: Scheduler, steps: int, free_blocks: int) -> int | None:
        """`admission_limit` as the scheduler will ask it ``steps`` decode-only steps from now,
        if each of those steps decodes one token of every running request and nothing else
        changes, with ``free_blocks`` device blocks free then; asking it has the effects asking
        `admission_limit` then would have. None (the default): the policy cannot tell.

        The simulator asks it to apply runs of decode steps at once while requests wait at the
        gate (`serve_jax.sim_runs`), step by step, stopping at the first step that admits.
        """
        return None


class FcfsLastPolicy(VictimPolicy):
    """vLLM V1's default: preempt the most recently admitted running request, by recompute.

    Args:
      mode: the preemption mode for every victim (RECOMPUTE as vLLM; OFFLOAD to use the host tier).
    """

    name = "fcfs_last"

    def __init__(self, mode: PreemptMode = PreemptMode.RECOMPUTE):
        self.mode = PreemptMode(mode)
        if self.mode == PreemptMode.OFFLOAD:
            self.name = "fcfs_last_offload"

    def select_victims(self, view: SchedulerView) -> list[tuple[Request, PreemptMode]]:
        if not view.running:
            return []
        return [(view.running[-1], self.mode)]


@dataclasses.dataclass(slots=True)
class ScheduledChunk:
    """Tokens of one request to run this step."""

    request_id: str
    start: int
    """Position of the first token (== num_computed_tokens before the step)."""
    num_tokens: int
    token_ids: tuple[int, ...]
    sample: bool
    """Whether this chunk reaches the end of the known tokens, so a token is sampled after it."""
    num_output_tokens: int
    """Output tokens so far (the index of the token sampled after this chunk; seeds RNG)."""
    sampling: Any = None


@dataclasses.dataclass
class SchedulerOutput:
    """One step's plan: plain data for an executor."""

    step: int
    prefills: list[ScheduledChunk] = dataclasses.field(default_factory=list)
    decodes: list[ScheduledChunk] = dataclasses.field(default_factory=list)
    preemptions: list[tuple[str, PreemptMode]] = dataclasses.field(default_factory=list)
    offloads: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    """(device block, host block) pairs to copy device -> host, issued after this step's compute."""
    restores: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    """(host block, device block) pairs to copy host -> device before this step's compute."""
    block_tables: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    """Device blocks of each scheduled request (copies; safe to keep)."""

    @property
    def chunks(self) -> list[ScheduledChunk]:
        return self.prefills + self.decodes

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(c.num_tokens for c in self.prefills) + sum(c.num_tokens for c in self.decodes)

    @property
    def is_empty(self) -> bool:
        """Nothing to run, copy or preempt (a step that only preempted still counts: its victims
        wait for the next step, which must run)."""
        return not (
            self.prefills or self.decodes or self.offloads or self.restores or self.preemptions
        )


@dataclasses.dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """Logprobs of one sampled token (from the model's raw logits)."""

    logprob: float
    """Of the sampled token."""
    top_ids: tuple[int, ...]
    """The most likely token ids, most likely first (as many as the request asked for)."""
    top_logprobs: tuple[float, ...]


@dataclasses.dataclass
class ExecutorOutput:
    """What an executor reports back for one `SchedulerOutput`."""

    sampled: dict[str, int] = dataclasses.field(default_factory=dict)
    """Token sampled for each chunk with ``sample=True``."""
    completed_offloads: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    completed_restores: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    step_seconds: float | None = None
    """Measured (or simulated) duration of the step, if known."""
    logprobs: dict[str, TokenLogprobs] = dataclasses.field(default_factory=dict)
    """Logprobs of the sampled token, for the chunks whose request asked for them."""


class Executor(Protocol):
    """Runs a `SchedulerOutput`: the JAX executor and the simulated executor implement this."""

    def execute(self, scheduler_output: SchedulerOutput) -> ExecutorOutput: ...


@dataclasses.dataclass(slots=True)
class RequestEvent:
    """New tokens of one request after a step (and whether it finished)."""

    request_id: str
    new_token_ids: tuple[int, ...]
    finished: bool
    status: RequestStatus
