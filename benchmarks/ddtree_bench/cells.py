"""Measuring a serving cell (one arm at one concurrency): repeated sustained loads, and the
interleaved order that compares arms within a few percent.

A cell is `repeats` measurements; each keeps `conc` requests in flight per replica until it
has run `min_cell_seconds` and sent `min_cell_requests` (one round of requests where neither is
set): time bounds a cell, a request count may extend it but never ends it early (at c = 64 a
request count alone ended cells after half a second, too short to measure).  Measured one arm
after another, a machine that drifts (another tenant, clocks, a host
that gets slower for minutes: repeats of one cell have spread by up to a quarter)
lands on whichever arm runs then, which a 3% bar cannot survive.  Interleaved, round r
measures every arm once (starting at arm r mod n), so drift falls on every arm alike and each
round is a paired comparison of the arms (`rounds_tok_s`, in round order).
"""

from __future__ import annotations

from pathlib import Path

from ddtree_bench import client
from ddtree_bench.server_log import LogWindow, full_load_decode


def cell_done(cfg, seconds: float, requests: int) -> bool:
    """A cell has run long enough: one round when no minimum is set, else every minimum set
    reached (seconds and requests)."""
    return seconds >= cfg.min_cell_seconds and requests >= cfg.min_cell_requests


def requests_for(cfg, conc: int) -> int:
    per = cfg.requests_per_level or max(2 * conc, 8)
    return per * len(cfg.gpus)


def warm_up(cfg, urls: list[str], prompts, params, conc: int) -> None:
    """One round of `conc` requests per replica, not recorded."""
    client.run_level(urls, prompts, params, conc, conc * len(urls), endpoint=cfg.endpoint)


def measure_once(cfg, urls: list[str], prompts, params, conc: int, bar,
                 logs: list[Path] = ()) -> tuple[dict, list]:
    """One measurement: (summary with its steady-state tokens/s and, from the servers' `logs`,
    their decode lines at full load (server_log.full_load_decode), per-request results)."""
    window = LogWindow(list(logs))
    if cfg.min_cell_seconds or cfg.min_cell_requests:  # sustained load to a minimum
        results, wall, drain_at = client.run_sustained(
            urls, prompts, params, conc, lambda s, k: cell_done(cfg, s, k), bar,
            endpoint=cfg.endpoint)
        steady = client.steady_tok_s(results, conc * len(urls), drain_at)
    else:  # one round of n requests
        results, wall = client.run_level(urls, prompts, params, conc, requests_for(cfg, conc),
                                         bar, endpoint=cfg.endpoint)
        steady = None
    server = full_load_decode(window.read(), conc) if logs else None
    return {**client.summarize(results, wall), "steady_tok_s": steady,
            "server_decode": server}, results


def cell_row(arm, conc: int, runs: list[tuple[dict, list]],
             interleaved: bool = False) -> tuple[list, dict]:
    """The cell's row from its measurements (in the order taken): the median measurement's
    summary, every measurement's tokens/s (ascending) and spread, and in interleaved runs the
    tokens/s in round order.  Returns (the median measurement's results, the row)."""
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
    return results, row


def measure_cell(cfg, urls: list[str], prompts, params, arm, conc: int,
                 progress_bar, logs: list[Path] = ()) -> tuple[list, dict]:
    """One (arm, concurrency) cell measured on its own: an optional warm-up round, then
    `cfg.repeats` measurements."""
    if cfg.warmup_per_cell:
        warm_up(cfg, urls, prompts, params, conc)
    runs = []
    for rep in range(cfg.repeats):
        with progress_bar(desc=f"{arm.name} c={conc} #{rep + 1}", leave=False) as bar:
            runs.append(measure_once(cfg, urls, prompts, params, conc, bar, logs))
    return cell_row(arm, conc, runs)


def measure_interleaved(cfg, live: list[tuple], prompts, params, conc: int,
                        progress_bar) -> list[tuple[list, dict]]:
    """Every arm of `live` ([(arm, urls, logs)], servers all up) at one concurrency, in rounds: per
    round one measurement of each arm, round r starting at arm r mod n (none always goes
    first), each after a warm-up round of its own with warmup_per_cell (an arm has waited
    idle through the others' turns).  Returns one (results, row) per arm, in `live`'s order."""
    runs: list[list] = [[] for _ in live]
    for rep in range(cfg.repeats):
        for k in range(len(live)):
            i = (rep + k) % len(live)
            arm, urls, logs = live[i]
            if cfg.warmup_per_cell:
                warm_up(cfg, urls, prompts, params, conc)
            with progress_bar(desc=f"{arm.name} c={conc} round {rep + 1}", leave=False) as bar:
                runs[i].append(measure_once(cfg, urls, prompts, params, conc, bar, logs))
    return [cell_row(arm, conc, r, interleaved=True) for (arm, _, _), r in zip(live, runs)]
