"""Collectives of a compiled XLA program and the compute that can hide them, read from its
scheduled HLO text.

A compiled module with ``is_scheduled=true`` lists each computation's instructions in the order
they run. `analyse_schedule` reads that text and, for every collective, finds:

- ``scheduled_share``: the compute (convolution and dot FLOPs, counted inside fusions and
  loops) that the schedule places between an asynchronous collective's ``*-start`` and its
  ``*-done``, as a share of the program's FLOPs: what the compiled program actually hides. A
  synchronous collective hides nothing.
- ``independent_share``: the compute that neither feeds the collective nor reads its result (the
  dependency graph of its computation): what any schedule could hide behind it. The difference
  is the overlap the compiler left on the table.

`hidden_fraction` turns either share into the hidden fraction of the collective time at a
target scale, given each collective's time there and the program's compute time. The ParaGAN
scaling model reads its train step this way (`paragan_jax.overlap`).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["CollectiveOp", "ScheduleReport", "analyse_schedule", "hidden_fraction"]

_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
    "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
}  # fmt: skip
_ARRAY = re.compile(r"\b(" + "|".join(_DTYPE_BYTES) + r")\[([\d,]*)\]")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%([^\s=]+)\s*=\s*(.*)$")
_HEADER = re.compile(r"^(?:ENTRY\s+)?%([^\s(]+)\s*\(.*\{\s*$")
_CALLED = re.compile(r"(?:calls|to_apply|body|condition)=%([^\s,}]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")


@dataclasses.dataclass(frozen=True)
class CollectiveOp:
    """One collective of a compiled program and the compute around it."""

    name: str
    kind: str
    is_async: bool
    payload_bytes: float
    """Bytes of the collective's larger side (all-reduce: the reduced buffer)."""
    scheduled_share: float
    """FLOPs scheduled between start and done, as a share of the program's FLOPs."""
    independent_share: float
    """FLOPs independent of the collective (neither feed it nor read it), as a share."""


@dataclasses.dataclass(frozen=True)
class ScheduleReport:
    """The collectives of one compiled program."""

    total_flops: float
    collectives: tuple[CollectiveOp, ...]

    def summary(self) -> dict[str, Any]:
        ops = self.collectives
        big = [c for c in ops if c.payload_bytes >= 1 << 16]  # gradient-sized (>= 64 KiB)
        return {
            "total_flops": self.total_flops,
            "collectives": len(ops),
            "async_collectives": sum(c.is_async for c in ops),
            "payload_bytes": sum(c.payload_bytes for c in ops),
            "large_collectives": len(big),
            "scheduled_share_mean_large": (
                float(np.mean([c.scheduled_share for c in big])) if big else 0.0
            ),
            "independent_share_mean_large": (
                float(np.mean([c.independent_share for c in big])) if big else 0.0
            ),
        }


def _arrays(type_text: str) -> list[tuple[str, list[int]]]:
    return [(d, [int(x) for x in dims.split(",") if x]) for d, dims in _ARRAY.findall(type_text)]


def _nbytes(type_text: str) -> float:
    return float(sum(_DTYPE_BYTES[d] * math.prod(s) for d, s in _arrays(type_text)))


def _split_type(rest: str) -> tuple[str, str]:
    """``TYPE opcode(...)...`` -> (TYPE, the rest from the opcode on)."""
    if rest.startswith("("):
        depth = 0
        for i, ch in enumerate(rest):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                return rest[: i + 1], rest[i + 1 :].lstrip()
    head, _, tail = rest.partition(" ")
    return head, tail


def _operands(text: str) -> tuple[str, str]:
    """``(a, b), attrs`` -> (``a, b``, ``attrs``)."""
    depth = 0
    for i, ch in enumerate(text):
        depth += ch == "("
        depth -= ch == ")"
        if depth == 0:
            return text[1:i], text[i + 1 :]
    return text[1:], ""


@dataclasses.dataclass
class _Instr:
    name: str
    type_text: str
    opcode: str
    operands: list[str]
    attrs: str
    called: list[str]


def _parse(text: str) -> dict[str, list[_Instr]]:
    comps: dict[str, list[_Instr]] = {}
    current: list[_Instr] | None = None
    for line in text.splitlines():
        head = _HEADER.match(line)
        if head:
            current = comps.setdefault(head.group(1), [])
            continue
        if line.strip() == "}":
            current = None
            continue
        m = _INSTR.match(line) if current is not None else None
        if not m:
            continue
        type_text, rest = _split_type(m.group(2))
        opcode, _, tail = rest.partition("(")
        ops_text, attrs = _operands("(" + tail)
        called = _CALLED.findall(attrs)
        for branches in _BRANCHES.findall(attrs):
            called += [b.strip().lstrip("%") for b in branches.split(",") if b.strip()]
        names = re.findall(r"%([^\s,()]+)", ops_text)
        current.append(_Instr(m.group(1), type_text, opcode.strip(), names, attrs, called))
    return comps


def _own_flops(ins: _Instr, types: dict[str, str]) -> float:
    out = _arrays(ins.type_text)
    if not out or ins.opcode not in ("dot", "convolution") or len(ins.operands) < 2:
        return 0.0
    out_elems = math.prod(out[0][1])
    lhs = _arrays(types.get(ins.operands[0], ""))
    rhs = _arrays(types.get(ins.operands[1], ""))
    if ins.opcode == "dot":
        dims = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", ins.attrs)
        if not lhs or not dims:
            return 0.0
        k = math.prod(lhs[0][1][int(i)] for i in dims.group(1).split(",") if i)
        return 2.0 * out_elems * k
    labels = re.search(r"dim_labels=\w+_(\w+)->", ins.attrs)
    if not rhs or not labels or "o" not in labels.group(1):
        return 0.0
    kernel = rhs[0][1]
    per_out = math.prod(kernel) / max(1, kernel[labels.group(1).index("o")])
    return 2.0 * out_elems * per_out


def _trip_count(ins: _Instr) -> int:
    m = re.search(r'"known_trip_count":\{"n":"(\d+)"', ins.attrs)
    return int(m.group(1)) if m else 1


def analyse_schedule(text: str) -> ScheduleReport:
    """Collectives of a compiled (scheduled) HLO module and the compute that can hide them."""
    comps = _parse(text)
    memo: dict[str, float] = {}

    def comp_flops(name: str) -> float:
        if name not in memo:
            memo[name] = 0.0  # guards recursion
            memo[name] = sum(instr_flops(i, comps[name]) for i in comps.get(name, []))
        return memo[name]

    type_cache: dict[int, dict[str, str]] = {}

    def instr_flops(ins: _Instr, comp: list[_Instr]) -> float:
        types = type_cache.setdefault(id(comp), {i.name: i.type_text for i in comp})
        inner = sum(comp_flops(c) for c in ins.called)
        return _own_flops(ins, types) + inner * (_trip_count(ins) if ins.opcode == "while" else 1)

    entry = next((m.group(1) for m in re.finditer(r"^ENTRY\s+%([^\s(]+)", text, re.M)), None)
    if entry is None:
        raise ValueError("no ENTRY computation in this HLO text")
    total = comp_flops(entry)
    found: list[CollectiveOp] = []
    # TPU async collective fusions (v4 and later) carry one collective through a start fusion,
    # compute fusions and a done fusion, each with a piece of it inside: the start stands for
    # the collective (`_collective_kind`), the pieces are not collectives of their own.
    pieces = {
        c
        for comp in comps.values()
        for ins in comp
        if ins.name.startswith(("async-collective-start", "async-collective-done"))
        for c in ins.called
    } | {name for name in comps if name.startswith("async_collective_fusion")}
    for comp in (c for name, c in comps.items() if name not in pieces):
        index = {ins.name: i for i, ins in enumerate(comp)}
        preds = {ins.name: [o for o in ins.operands if o in index] for ins in comp}
        users: dict[str, list[str]] = {ins.name: [] for ins in comp}
        for ins in comp:
            for op in ins.operands:
                if op in users:
                    users[op].append(ins.name)
        cost = [instr_flops(ins, comp) for ins in comp]
        for pos, ins in enumerate(comp):
            kind, is_async, done_pos = _collective_kind(ins, comp, comps, users, index)
            if kind is None:
                continue
            done = comp[done_pos]
            before = _closure(ins.name, preds)
            after = _closure(done.name, users)
            tied = before | after | {ins.name, done.name}
            indep = sum(c for i, c in enumerate(cost) if comp[i].name not in tied)
            between = sum(cost[pos + 1 : done_pos]) if is_async else 0.0
            payload = max(
                _nbytes(done.type_text),
                sum(_nbytes(comp[index[o]].type_text) for o in ins.operands if o in index),
            )
            found.append(
                CollectiveOp(
                    ins.name,
                    kind,
                    is_async,
                    payload,
                    between / total if total else 0.0,
                    indep / total if total else 0.0,
                )
            )
    return ScheduleReport(total, tuple(found))


def _collective_kind(ins, comp, comps, users, index):
    """(kind, is_async, position of its done) of a collective instruction, else (None, ...)."""
    op = ins.opcode
    if op in _COLLECTIVES:
        return op, False, index[ins.name]
    if op == "fusion" and ins.name.startswith("async-collective-start"):
        inner = [i.opcode for c in ins.called for i in comps.get(c, [])]
        kind = next((k for k in _COLLECTIVES if k in inner), None)
        done = [index[u] for u in _closure(ins.name, users) if u.startswith("async-collective-d")]
        if kind is None:
            return None, False, -1
        return kind, True, min(done) if done else index[ins.name]
    if not op.endswith("-start"):
        return None, False, -1
    kind = op[: -len("-start")]
    if kind == "async":  # a generic async wrapper: the collective is in its called computation
        inner = [i.opcode for c in ins.called for i in comps.get(c, [])]
        kind = next((k for k in _COLLECTIVES if k in inner), None)
    if kind not in _COLLECTIVES:
        return None, False, -1
    dones = [u for u in users[ins.name] if comp[index[u]].opcode.endswith("-done")]
    return kind, True, index[dones[0]] if dones else index[ins.name]


def _closure(start: str, edges: dict[str, list[str]]) -> set[str]:
    """Every instruction reachable from `start` along `edges` (operands or users)."""
    seen: set[str] = set()
    todo = [start]
    while todo:
        for nxt in edges[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def hidden_fraction(
    report: ScheduleReport,
    collective_seconds: Callable[[CollectiveOp], float],
    compute_seconds: float,
    scheduled: bool = True,
) -> float:
    """Share of the program's collective time hidden behind its compute at a target scale.

    Each collective hides ``min(its time, share x compute_seconds)``, with ``share`` the compute
    scheduled inside it (``scheduled=True``: what the compiled program does) or independent of
    it (``False``: what a schedule could do; an upper bound, since collectives that share the
    same independent compute each count it).
    """
    times = [collective_seconds(c) for c in report.collectives]
    total = sum(times)
    if total <= 0:
        return 0.0
    hidden = sum(
        min(t, (c.scheduled_share if scheduled else c.independent_share) * compute_seconds)
        for c, t in zip(report.collectives, times)
    )
    return hidden / total
