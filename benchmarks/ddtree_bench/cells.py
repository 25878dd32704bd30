"""Measuring a serving cell (arms at one concurrency): fixed work, and the interleaved order that
compares arms within a few percent.

Fixed work: every arm of a cell serves the same request list (the same prompts in the same order,
greedy, max_new_tokens fixed, EOS ignored where no grammar ends a request), `conc` requests in
flight per replica, and the measured quantity is the wall time to finish the list: output tok/s
is the list's output tokens over that time, and a ratio between two arms is a ratio of times.
(A time-bounded cell would let a faster arm serve more, and other, requests.)  The list's length
is a request count (`requests_per_level`) or, with `cell_seconds`, sized from a probe: see
`size_requests`.

Interleaved (`interleave`): round r measures every arm once, starting at arm r mod n, so a
machine that drifts (another tenant, clocks, a host that gets slower for minutes) slows every arm
alike and each round is a paired comparison (`rounds_wall_s`, `rounds_tok_s`, in round order).
Arms measured one after another (no interleave) may instead keep a sustained load until
`min_cell_seconds` / `min_cell_requests`.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable

from ddtree_bench import client
from ddtree_bench.server_log import LogWindow, full_load_decode

WARMUP_S = 1.5  # per measurement: its warm-up round and the drain of the last requests
Log = Callable[[str], None]


def cell_done(cfg, seconds: float, requests: int) -> bool:
    """A sustained cell has run long enough: every minimum set reached (seconds and requests)."""
    return seconds >= cfg.min_cell_seconds and requests >= cfg.min_cell_requests


def requests_for(cfg, conc: int) -> int:
    per = cfg.requests_per_level or max(2 * conc, 8)
    return per * len(cfg.gpus)


def size_requests(seconds: float, wave: int, probe_walls: list[float]) -> int:
    """The request list of a fixed-work cell: each arm's probe served one wave of `wave`
    requests (`conc` per replica) in `probe_walls[i]` s; the list is as many requests as the
    slowest arm serves in `seconds` at its probe's rate, rounded up to whole waves, at least
    one.  The slowest arm then needs about `seconds` and a faster one less (a probe of one wave
    includes its ramp and drain, so the estimate errs long: measurements come out at or below
    `seconds`).  With `seconds` in 4-8 s, a cell stays long enough to time and short enough to
    repeat."""
    slowest = max(probe_walls)
    per_s = wave / slowest if slowest > 0 else float(wave)
    return wave * max(1, math.ceil(seconds * per_s / wave))


def cell_estimate(cfg, n_arms: int) -> float | None:
    """Expected wall time of one level's cells for `n_arms` arms, an upper bound: each arm's
    probe or warm-up (WARMUP_S), then `repeats` measurements of at most cell_seconds (or at
    least min_cell_seconds) plus WARMUP_S each.  None for cells of a bare request count (their
    time depends on the arms' speed)."""
    seconds = cfg.cell_seconds or cfg.min_cell_seconds
    if not seconds:
        return None
    return n_arms * (cfg.repeats * (seconds + WARMUP_S) + WARMUP_S)


def warm_up(cfg, urls: list[str], prompts, params, conc: int) -> float:
    """One round of `conc` requests per replica, not recorded; returns its wall time."""
    _, wall = client.run_level(urls, prompts, params, conc, conc * len(urls),
                               endpoint=cfg.endpoint)
    return wall


def measure_fixed(cfg, urls: list[str], prompts, params, conc: int, n: int,
                  logs: list[Path] = ()) -> tuple[dict, list]:
    """The first `n` requests of the cell's list (request i: prompt i mod len(prompts), replica
    i mod replicas) with `conc` in flight per replica: (summary with its wall time, tok/s and,
    from the servers' `logs`, their decode lines at full load, per-request results)."""
    window = LogWindow(list(logs))
    results, wall = client.run_level(urls, prompts, params, conc, n, endpoint=cfg.endpoint)
    server = full_load_decode(window.read(), conc) if logs else None
    return {**client.summarize(results, wall), "steady_tok_s": None,
            "server_decode": server}, results


def measure_once(cfg, urls: list[str], prompts, params, conc: int, bar,
                 logs: list[Path] = ()) -> tuple[dict, list]:
    """One sustained measurement (arms measured one after another): (summary with its
    steady-state tokens/s and the servers' decode lines at full load, per-request results)."""
    window = LogWindow(list(logs))
    results, wall, drain_at = client.run_sustained(
        urls, prompts, params, conc, lambda s, k: cell_done(cfg, s, k), bar,
        endpoint=cfg.endpoint)
    steady = client.steady_tok_s(results, conc * len(urls), drain_at)
    server = full_load_decode(window.read(), conc) if logs else None
    return {**client.summarize(results, wall), "steady_tok_s": steady,
            "server_decode": server}, results


def cell_row(arm, conc: int, runs: list[tuple[dict, list]],
             interleaved: bool = False) -> tuple[list, dict]:
    """The cell's row from its measurements (in the order taken): the median measurement's
    summary, every measurement's tokens/s (ascending) and spread, and in interleaved runs the
    wall times, tokens/s and output tokens in round order.  Returns (the median measurement's
    results, the row)."""
    ordered = sorted(runs, key=lambda r: r[0]["output_tok_s"] or 0.0)
    summary, results = ordered[len(ordered) // 2]
    row = dict(arm=arm.name, algorithm=arm.algorithm, budget=arm.budget, concurrency=conc,
               **summary)
    if len(runs) > 1:
        rates = [r[0]["output_tok_s"] for r in ordered]
        row["runs_tok_s"] = rates
        row["runs_steady_tok_s"] = [r[0]["steady_tok_s"] for r in ordered]
        row["spread"] = round((max(rates) - min(rates)) / summary["output_tok_s"], 3) \
            if summary["output_tok_s"] else None
        row["runs_server_decode"] = [r[0].get("server_decode") for r in ordered]
    if interleaved:
        row["rounds_tok_s"] = [r[0]["output_tok_s"] for r in runs]
        row["rounds_wall_s"] = [r[0]["wall_s"] for r in runs]
        row["rounds_output_tokens"] = [r[0]["output_tokens"] for r in runs]
    return results, row


def measure_line(arm: str, conc: int, rnd: str, summary: dict) -> str:
    """The log's line for one measurement: arm, concurrency, round, requests, seconds, tok/s."""
    tok_s = summary["output_tok_s"] or 0.0
    errors = f"  {summary['errors']} errors" if summary["errors"] else ""
    return (f"{arm:<24} c={conc:<3} round {rnd:<5} {summary['requests']:>5} requests "
            f"{summary['wall_s']:7.2f} s {tok_s:>10,.0f} tok/s{errors}")


def measure_cell(cfg, urls: list[str], prompts, params, arm, conc: int, progress_bar,
                 logs: list[Path] = (), n: int | None = None,
                 log: Log = print) -> tuple[list, dict]:
    """One (arm, concurrency) cell measured on its own: an optional warm-up round, then
    `cfg.repeats` measurements, each of the fixed list of `n` requests (or, with a sustained
    minimum set, a sustained load)."""
    if cfg.warmup_per_cell:
        warm_up(cfg, urls, prompts, params, conc)
    runs = []
    for rep in range(cfg.repeats):
        if cfg.min_cell_seconds or cfg.min_cell_requests:
            with progress_bar(desc=f"{arm.name} c={conc} #{rep + 1}", leave=False) as bar:
                runs.append(measure_once(cfg, urls, prompts, params, conc, bar, logs))
        else:
            runs.append(measure_fixed(cfg, urls, prompts, params, conc,
                                      n or requests_for(cfg, conc), logs))
            log(measure_line(arm.name, conc, f"{rep + 1}/{cfg.repeats}", runs[-1][0]))
    return cell_row(arm, conc, runs)


def cell_requests(cfg, live: list[tuple], prompts, params, conc: int) -> int:
    """The length of a cell's request list: sized from a probe of every arm of `live` (one
    wave each, which also warms it up) with `cfg.cell_seconds`, else the fixed count."""
    if not cfg.cell_seconds:
        return requests_for(cfg, conc)
    walls = [warm_up(cfg, urls, prompts, params, conc) for _, urls, _ in live]
    replicas = len(live[0][1])
    return size_requests(cfg.cell_seconds, conc * replicas, walls)


def measure_interleaved(cfg, live: list[tuple], prompts, params, conc: int,
                        log: Log = print) -> list[tuple[list, dict]]:
    """Every arm of `live` ([(arm, urls, logs)], servers all up) at one concurrency, on one
    request list (cell_requests), in rounds: per round one measurement of each arm, round r
    starting at arm r mod n (none always goes first), each after a warm-up round of its own
    with warmup_per_cell (an arm has waited idle through the others' turns).  Logs one line per
    measurement.  Returns one (results, row) per arm, in `live`'s order."""
    n = cell_requests(cfg, live, prompts, params, conc)
    runs: list[list] = [[] for _ in live]
    for rep in range(cfg.repeats):
        for k in range(len(live)):
            i = (rep + k) % len(live)
            arm, urls, logs = live[i]
            if cfg.warmup_per_cell:
                warm_up(cfg, urls, prompts, params, conc)
            runs[i].append(measure_fixed(cfg, urls, prompts, params, conc, n, logs))
            log(measure_line(arm.name, conc, f"{rep + 1}/{cfg.repeats}", runs[i][-1][0]))
    return [cell_row(arm, conc, r, interleaved=True) for (arm, _, _), r in zip(live, runs)]
