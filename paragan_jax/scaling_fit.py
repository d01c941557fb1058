"""The fit of the scaling model's CPU check and its predictions (`paragan_jax.scaling_check`).

`fit_and_predict` reads the workers' measurements (step times of each scheme, width and process
count, the collectives XLA compiled into each program, a bare all-reduce at several sizes) and
fits the model's terms on 1 and 2 processes only; every other pair is a prediction whose error
is reported with the load average it was measured under. NumPy only: the recorded measurements
in tests/paragan/data are fitted again without running anything.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tapas_jax.collectives import compiled_collective_terms, fit_alpha_beta

from .scaling import expected_max_normal

__all__ = ["fit_and_predict"]


def fit_and_predict(
    res: dict[str, Any],
    flops: dict[str, float],
    cores: int,
    async_flops: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Fits on (first width; 1 and 2 processes) and predicts every other measured pair.

    With three or more widths, the second width's 1- and 2-process steps are fitted too, so that
    a step's time is ``fixed + FLOPs / rate`` (a per-step cost that does not grow with the model:
    op dispatch and small kernels, which dominate small models on a CPU) rather than ``FLOPs /
    rate`` alone, and the per-hop latency is read from two 2-process steps instead of one (on
    two cores that single median moved 67-89 ms between quiet runs, and 3 and 4 processes
    multiply its error by their hops); the remaining widths are then a model size the fit never
    saw. With two widths the fixed part is zero.

    Async pairs (`paragan_jax.process_groups.GroupAsyncRunner`, measured when `res` has
    ``async:width:n`` step times) are predicted from the same fit: each group's step is its
    FLOPs at the fitted rate, on cores shared with the other group while both compute
    (`_share_cores`), plus its own all-reduces at the fitted per-hop latency (the two groups'
    rings take turns when processes outnumber cores); the iteration waits for the slower group,
    then pays the exchange (its compiled all-gather over all processes). The first width at 2
    processes (one G, one D) fits one more number, the exchange's host cost (packing rows,
    placing arrays); 3 and 4 processes and the other widths are predictions.

    Args:
      res: the workers' measurements (`paragan_jax.scaling_check.run_processes`).
      flops: each width's step FLOPs per process (`paragan_jax.scaling_check.step_flops`).
      cores: the machine's cores.
      async_flops: each async pair's group FLOPs per process
        (`paragan_jax.scaling_check.async_plan`).

    Returns:
      ``rows`` (median steps) and ``rows_min`` (fastest steps, no jitter term), each row with its
      role, measured and predicted seconds, error, terms and load average; and the fit.
    """
    widths = [int(w) for w in res["widths"]]
    counts = sorted(int(n) for n in res["counts"])
    if counts[:2] != [1, 2] or len(counts) < 3:
        raise ValueError(f"processes {counts}: need 1 and 2 (the fit) and a larger count")
    w0 = widths[0]
    alpha_lone, bw = fit_alpha_beta({int(k): v for k, v in res["allreduce_s"].items()}, 2)
    base = np.array(res["step_times"][f"{w0}:1"])
    util = float(np.median(np.array(res["cpu_times"][f"{w0}:1"]) / base))
    q25, q75 = np.percentile(base, [25, 75])

    w1 = widths[1] if len(widths) >= 3 else None
    fitted = {(w0, 1), (w0, 2)} | ({(w1, 1), (w1, 2)} if w1 is not None else set())

    def rows_for(stat, with_jitter: bool):
        t1 = float(stat(base))
        fixed = 0.0
        rate = flops[str(w0)] / t1  # achieved FLOP/s of one process
        if w1 is not None:
            t_w1 = float(stat(res["step_times"][f"{w1}:1"]))
            df = flops[str(w1)] - flops[str(w0)]
            if df != 0 and (t_w1 - t1) / df > 0:  # else no fixed part can be told apart
                rate = df / (t_w1 - t1)
                fixed = max(0.0, t1 - flops[str(w0)] / rate)
                rate = flops[str(w0)] / (t1 - fixed)
        jit_rel = float((q75 - q25) / 1.349 / np.median(base)) if with_jitter else 0.0
        terms = {}
        for w in widths:
            for n in counts:
                key = f"{w}:{n}"
                coll = res["collectives"].get(key, {"count": {}, "moved_bytes": {}})
                hops, sent = compiled_collective_terms(coll["count"], coll["moved_bytes"], n, n)
                compute = _share_cores([fixed + flops[str(w)] / rate] * n, util, cores)[0]
                jit = jit_rel * expected_max_normal(n) * compute
                measured = float(stat(res["step_times"][key]))
                terms[(w, n)] = (measured, compute, hops, sent, jit, coll)
        # Per-hop latency: what the fitted widths' 2-process steps spend beyond compute,
        # bandwidth and jitter, over their hops (two widths halve the noise of one on a CPU).
        pts = [terms[(w, 2)] for w in ([w0] if w1 is None else [w0, w1])]
        hops2 = sum(h for _, _, h, _, _, _ in pts)
        spent2 = sum(m - c - s / bw - j for m, c, _, s, j, _ in pts)
        alpha = max(1e-6, spent2 / hops2) if hops2 else 1e-6
        rows = []
        for (w, n), (measured, compute, hops, sent, jit, coll) in terms.items():
            comm = hops * alpha + sent / bw
            pred = compute + comm + jit
            role = "prediction"
            if (w, n) in fitted:
                role = {
                    (w0, 1): "fits FLOP/s, cores, jitter",
                    (w1, 1): "fits fixed step cost",
                }.get((w, n), "fits per-hop latency")
            loads = res.get("load_average", {}).get(f"{w}:{n}", [])
            rows.append(
                {
                    "width": w,
                    "processes": n,
                    "role": role,
                    "measured_s": measured,
                    "predicted_s": pred,
                    "error": pred / measured - 1.0,
                    "compute_s": compute,
                    "collectives_s": comm,
                    "latency_hops": hops,
                    "bytes_sent": sent,
                    "jitter_s": jit,
                    "load_average": float(np.mean(loads)) if loads else None,
                    "collectives": coll["count"],
                    "scheme": "sync",
                }
            )
        fit = {"stat": stat, "rate": rate, "fixed": fixed, "jit_rel": jit_rel, "alpha": alpha}
        host = None
        if async_keys:
            rows_a, host = _async_rows(res, async_flops, fit, util, cores, bw, w0)
            rows += rows_a
        return rows, alpha, rate, fixed, host

    async_keys = [k for k in res["step_times"] if k.startswith("async:")]
    if async_keys and not async_flops:
        raise ValueError("async pairs were measured: need their group FLOPs (async_plan)")
    rows, alpha, rate, fixed, host = rows_for(np.median, True)
    # Best case (fastest step of each pair, no jitter term): least touched by other jobs.
    rows_min, alpha_min, _, _, _ = rows_for(np.min, False)
    return {
        "exchange_host_s": host,
        "async_flops": async_flops,
        "rows": rows,
        "rows_min": rows_min,
        "fitted_width": w0,
        "fixed_step_s": fixed,
        "cores": cores,
        "cores_busy_1_process": util,
        "achieved_flops_per_s": rate,
        "alpha_s": alpha,
        "alpha_fastest_s": alpha_min,
        "alpha_lone_allreduce_s": alpha_lone,
        "bandwidth_Bps": bw,
        "step_flops": flops,
    }


def _share_cores(alone_s: list[float], util: float, cores: int) -> list[float]:
    """When each of several processes, started together, finishes its compute on shared cores.

    A process alone takes ``alone_s`` seconds using ``util`` cores (``alone_s * util``
    core-seconds of work). Running processes share the cores equally, none taking more than
    ``util``; when one finishes, the others get its cores. The sync rows' processes do equal
    work, so all finish together at ``alone * max(1, n * util / cores)``; in the async scheme
    the smaller group finishes first and the larger one runs on the freed cores for the rest of
    its step.
    """
    if util <= 0 or cores <= 0:
        raise ValueError(f"need util > 0 and cores > 0, got {util} and {cores}")
    left = [t * util for t in alone_s]
    done = [0.0] * len(left)
    running, now = set(range(len(left))), 0.0
    while running:
        rate = min(util, cores / len(running))
        step = min(left[i] for i in running) / rate
        now += step
        for i in list(running):
            left[i] -= step * rate
            if left[i] <= 1e-12 * max(1.0, alone_s[i]):
                done[i] = now
                running.discard(i)
    return done


def _async_rows(res, async_flops, fit, util: float, cores: int, bw: float, w0: int):
    """The async rows of `fit_and_predict` (see there) and the fitted exchange host cost."""
    stat, alpha, k = fit["stat"], fit["alpha"], int(res.get("staleness", 1))
    terms = {}
    for key in (k_ for k_ in res["step_times"] if k_.startswith("async:")):
        w, n = (int(v) for v in key.split(":")[1:])
        af = async_flops[f"{w}:{n}"]
        n_g = af["g_processes"]
        alone_g = fit["fixed"] + af["g"] / fit["rate"]  # one process with the machine
        alone_d = fit["fixed"] + af["d"] / fit["rate"]
        t_g, t_d = _share_cores([alone_g] * n_g + [alone_d] * (n - n_g), util, cores)[
            n_g - 1 : n_g + 1
        ]

        def comm(name: str, p: int, key=key) -> float:
            c = res["collectives"].get(f"{key}:{name}")
            if c is None:
                raise ValueError(f"no compiled collectives recorded for {key}:{name}")
            hops, sent = compiled_collective_terms(c["count"], c["moved_bytes"], c["devices"], p)
            return hops * alpha + sent / bw

        comm_g, comm_d = comm("g", n_g), comm("d", n - n_g)
        if n <= cores:  # every process on a core of its own: the groups' rings run side by side
            side_g, side_d = t_g + comm_g, t_d + comm_d
        else:  # a hop needs both ends on a core at once: with fewer cores the rings take turns
            side_g = side_d = max(t_g, t_d) + comm_g + comm_d
        snap = comm("exchange_snapshot", n)  # D's params ride along every k iterations
        exchange = snap if k == 1 else ((k - 1) * comm("exchange", n) + snap) / k
        jit = fit["jit_rel"] * expected_max_normal(n) * max(t_g, t_d)
        measured = float(stat(res["step_times"][key]))
        slow = (side_g, t_g) if side_g >= side_d else (side_d, t_d)
        terms[(w, n)] = (measured, slow, exchange, jit, t_g, t_d, n_g, key)
    if (w0, 2) not in terms:
        raise ValueError(f"async pairs need width {w0} at 2 processes (the exchange host fit)")
    m2, slow2, x2, j2, *_ = terms[(w0, 2)]
    host = max(0.0, m2 - slow2[0] - x2 - j2)
    rows = []
    for (w, n), (measured, slow, exchange, jit, t_g, t_d, n_g, key) in terms.items():
        pred = slow[0] + exchange + jit + host
        loads = res.get("load_average", {}).get(key, [])
        rows.append(
            {
                "scheme": "async",
                "width": w,
                "processes": n,
                "g_processes": n_g,
                "role": "fits exchange host cost" if (w, n) == (w0, 2) else "prediction",
                "measured_s": measured,
                "predicted_s": pred,
                "error": pred / measured - 1.0,
                "compute_s": max(t_g, t_d),
                "g_compute_s": t_g,
                "d_compute_s": t_d,
                "collectives_s": slow[0] - slow[1] + exchange,
                "exchange_s": exchange,
                "exchange_host_s": host,
                "jitter_s": jit,
                "load_average": float(np.mean(loads)) if loads else None,
            }
        )
    return rows, host
