"""The flags every serve command shares, with one name and one meaning each.

``replay``, ``bench`` and ``simulate`` pick their requests with the same workload flags (they
fill a `serve_jax.workloads.WorkloadConfig`), and state their SLOs in milliseconds with the same
two flags. vLLM's names and meanings where vLLM has the flag (``--burstiness`` is the gamma
shape of the inter-arrival times, ``--num-requests``, ``--seed``). Everything else a command runs
with is its config dataclass: ``--config <preset or .yaml>`` plus ``key=value`` overrides, listed
by ``--help`` (`tapas_jax.commands.command_parser`).
"""

from __future__ import annotations

import argparse

from serve_jax.preemption import ABLATIONS, POLICY_NAMES
from serve_jax.workloads import WORKLOAD_NAMES, WorkloadConfig

__all__ = [
    "add_workload_args",
    "workload_config",
    "add_policy_args",
    "policy_names",
    "add_slo_args",
    "add_tqdm_flag",
]


def add_workload_args(p: argparse.ArgumentParser, defaults: WorkloadConfig) -> None:
    """Adds the workload flags (defaults from ``defaults``) to a command's parser."""
    g = p.add_argument_group("workload (the same flags for replay, bench and simulate)")
    g.add_argument(
        "--workload",
        "--trace",
        dest="workload",
        default=defaults.name,
        metavar="NAME",
        help=f"{', '.join(WORKLOAD_NAMES)}, or an Azure-format CSV path (.csv, .csv.gz) "
        f"(TIMESTAMP, ContextTokens, GeneratedTokens); default {defaults.name}",
    )
    g.add_argument(
        "--num-requests",
        type=int,
        default=defaults.num_requests,
        help=f"keep the first N requests (default {defaults.num_requests or 'all'})",
    )
    g.add_argument("--skip", type=int, default=defaults.skip, help="trace rows skipped first")
    g.add_argument(
        "--duration-s",
        type=float,
        default=defaults.duration_s,
        help="span of arrivals: a trace keeps its first seconds, a generator draws over it "
        "(default: a trace's whole length, one hour for a generator)",
    )
    g.add_argument(
        "--rate",
        type=float,
        default=defaults.rate,
        help="arrival rate req/s (agentic: sessions/s), a gamma process; a trace's timestamps "
        "are replaced (default: a trace keeps its own, generators draw 0.05/s)",
    )
    g.add_argument(
        "--burstiness",
        type=float,
        default=defaults.burstiness,
        help="gamma shape of the inter-arrival times: 1 Poisson, < 1 burstier (vLLM's meaning; "
        "coefficient of variation 1/sqrt(burstiness))",
    )
    g.add_argument(
        "--rate-scale",
        type=float,
        default=defaults.rate_scale,
        help="arrivals this many times faster (follow-up turns' think times too)",
    )
    g.add_argument(
        "--token-scale",
        type=float,
        default=defaults.token_scale,
        help="multiply prompt and output lengths by this",
    )
    g.add_argument("--max-input-len", type=int, default=defaults.max_input_len, help="clip prompts")
    g.add_argument(
        "--max-output-len", type=int, default=defaults.max_output_len, help="clip outputs"
    )
    g.add_argument(
        "--seed", type=int, default=defaults.seed, help="seed of generators, arrivals, prompts"
    )


def workload_config(args: argparse.Namespace) -> WorkloadConfig:
    """The `WorkloadConfig` of parsed workload flags."""
    return WorkloadConfig(
        name=args.workload,
        num_requests=args.num_requests,
        skip=args.skip,
        duration_s=args.duration_s,
        rate=args.rate,
        burstiness=args.burstiness,
        rate_scale=args.rate_scale,
        token_scale=args.token_scale,
        max_input_len=args.max_input_len,
        max_output_len=args.max_output_len,
        seed=args.seed,
    )


def add_policy_args(p: argparse.ArgumentParser) -> None:
    """Adds the policy choice and ``predictive``'s two knobs (simulate and crosscheck)."""
    p.add_argument(
        "--policies",
        default=",".join(POLICY_NAMES),
        help=f"comma-separated names: {', '.join(POLICY_NAMES)} (the default), ablations "
        f"{', '.join(ABLATIONS)}",
    )
    p.add_argument(
        "--gate-quantile",
        type=float,
        default=None,
        help="predictive: quantile of the remaining length its admission gate uses (default 0.7)",
    )
    p.add_argument(
        "--cheap-preemption-steps",
        type=float,
        default=None,
        help="predictive: admit past the gate when a later recompute would cost at most this "
        "many decode steps (default 0: never)",
    )


def policy_names(args: argparse.Namespace) -> list[str]:
    """The names given to ``--policies``; an empty list is an error."""
    names = [p.strip() for p in args.policies.split(",") if p.strip()]
    if not names:
        raise ValueError("--policies is empty")
    return names


def add_slo_args(p: argparse.ArgumentParser, ttft_ms: float | None, tpot_ms: float | None) -> None:
    """``--slo-ttft-ms`` and ``--slo-tpot-ms``: the objectives of goodput, in milliseconds."""
    p.add_argument(
        "--slo-ttft-ms", type=float, default=ttft_ms, help=f"TTFT objective, ms (default {ttft_ms})"
    )
    p.add_argument(
        "--slo-tpot-ms", type=float, default=tpot_ms, help=f"TPOT objective, ms (default {tpot_ms})"
    )


def add_tqdm_flag(p: argparse.ArgumentParser) -> None:
    """``--disable-tqdm``: no progress bar (vLLM's flag)."""
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
