"""What a run would do, without starting anything (`ddtree-bench --dry-run`, on any machine):
the arms and replicas, the cells, the inputs and whether they are here, every server's launch as
a shell line that runs as printed (its environment settings, CUDA_VISIBLE_DEVICES included,
prefixed and every word shell-quoted), and the expected duration."""

from __future__ import annotations

import math

from ddtree_bench import cells
from ddtree_bench.config import Arm, BenchConfig, replica_gpus
from ddtree_bench.run import (cost_arms, input_status, model_ref, requests_for, run_inputs,
                              server_spec)

PLAN_PORT = 30000  # the printed commands listen on 30000, 30001, ...; a run picks free ports
PROFILE_S = 10.0  # one profile: the load's ramp, the profiled steps, the trace written and read


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def expected_seconds(cfg: BenchConfig, arms: list[Arm]) -> tuple[float, list[str], bool]:
    """(seconds, the terms they add up from, complete): each startup group's start on a cold
    machine (cfg.startup_seconds), each level's cells (cells.cell_estimate) and each profile
    (PROFILE_S, twice where launches are counted).  Not complete where a part's time depends
    on what the run measures (cells of a bare request count, cost mode's steps)."""
    groups = math.ceil(len(arms) / cfg.startup_group)
    total, terms, complete = groups * cfg.startup_seconds, [
        f"startup {_count(groups, 'group')} x {cfg.startup_seconds:g} s"], True
    if cfg.cost_mode.enabled:
        complete = False
        terms.append(f"cost cells: {len(arms)} arms x {len(cfg.cost_mode.batch_sizes)} batch "
                     f"sizes x {cfg.cost_mode.new_tokens} steps at the measured step time")
    elif cfg.concurrency:
        per_level = cells.cell_estimate(cfg, len(arms))
        if per_level is None:
            complete = False
            terms.append(f"{len(cfg.concurrency)} levels of fixed request counts, at the arms' "
                         "speed")
        else:
            total += per_level * len(cfg.concurrency)
            seconds = cfg.cell_seconds or cfg.min_cell_seconds
            terms.append(f"{len(cfg.concurrency)} levels x {len(arms)} arms x ({cfg.repeats} x "
                         f"({seconds:g} s + {cells.WARMUP_S:g} s) + {cells.WARMUP_S:g} s)")
    recordings = (2 if cfg.profile.launches else 1) + int(cfg.profile.host_samples)
    profiles = len(arms) * len(cfg.profile.batches) * recordings
    if profiles:
        total += profiles * PROFILE_S
        terms.append(f"{profiles} profiles x {PROFILE_S:g} s"
                     + (" (host samples included)" if cfg.profile.host_samples else ""))
    return total, terms, complete


def _cells_line(cfg: BenchConfig) -> str:
    if cfg.cost_mode.enabled:
        cm = cfg.cost_mode
        return (f"cost mode: batch sizes {cm.batch_sizes}, prompt {cm.prompt_len} tokens, "
                f"{cm.new_tokens} new tokens; random Qwen3-8B-shaped weights written to "
                f"{cm.workdir}")
    if not cfg.concurrency:
        return "no throughput cells (profile only)"
    if cfg.min_cell_seconds or cfg.min_cell_requests:
        minimum = " and ".join(x for x in (
            f"{cfg.min_cell_seconds:g} s" if cfg.min_cell_seconds else "",
            f"{cfg.min_cell_requests} requests" if cfg.min_cell_requests else "") if x)
        cell = f"each cell a sustained load until {minimum}"
    elif cfg.cell_seconds:
        cell = (f"fixed work: every arm of a level serves one request list, sized from a probe "
                f"so a measurement takes about {cfg.cell_seconds:g} s")
    else:
        cell = "fixed work: " + ", ".join(f"{requests_for(cfg, c)} requests at {c}"
                                          for c in cfg.concurrency)
    cell += f", x{cfg.repeats}" + (" in interleaved rounds" if cfg.interleave else "")
    prompts = (f"{cfg.prompts.limit} random prompts of {cfg.cost_mode.prompt_len} tokens"
               if cfg.random_weights else
               f"prompts {cfg.prompts.source} (first {cfg.prompts.limit})")
    return (f"concurrency {cfg.concurrency} per replica, {cell}; {cfg.max_new_tokens} new "
            f"tokens, temperature {cfg.temperature}, {cfg.endpoint} endpoint, {prompts}")


def server_lines(cfg: BenchConfig, arms: list[Arm], gpus: list[int]) -> list[str]:
    """Per replica of each arm, a comment naming it and its launch as one runnable line."""
    if cfg.cost_mode.enabled or cfg.random_weights:
        cm = cfg.cost_mode
        model, drafter = f"{cm.workdir}/qwen3_8b_random", f"{cm.workdir}/qwen3_8b_dflash_random"
        extra = ["--skip-tokenizer-init"]
    else:
        model, drafter, extra = model_ref(cfg.model_path), model_ref(cfg.draft_model_path), []
    lines, port = [], PLAN_PORT
    for arm in arms:
        spec = server_spec(cfg, arm, model, drafter, extra=extra)
        for g in replica_gpus(gpus, arm.tp):
            lines += [f"  # [{arm.name}, GPU {g}]", f"  {spec.shell_command(port, g)}"]
            port += 1
    return lines


def plan(cfg: BenchConfig, only: list[str] | None) -> str:
    """What a run would do, without starting anything (--dry-run)."""
    if cfg.cost_mode.enabled:
        arms = [a for a in cost_arms(cfg) if only is None or a.name in only]
        gpus = cfg.gpus[:1]
    else:
        arms, gpus = cfg.arms, cfg.gpus
    tps = sorted({a.tp for a in arms})
    replicas = " / ".join(_count(len(gpus) // tp, "replica") + (f" of tp {tp}" if tp > 1 else "")
                          for tp in tps)
    lines = [f"config {cfg.name}: {_count(len(arms), 'arm')} x {replicas} "
             f"(GPUs {gpus}), {_count(min(cfg.startup_group, len(arms)), 'arm')} started "
             "together", _cells_line(cfg)]
    if cfg.profile.batches:
        lines.append(f"profiles: every arm at batch {cfg.profile.batches}, {cfg.profile.steps} "
                     "decode steps each" + (", again with the host recorded for its launches"
                                            if cfg.profile.launches else ""))
    seconds, terms, complete = expected_seconds(cfg, arms)
    lines.append(f"expected duration: {'at least ' if not complete else ''}~{seconds / 60:.1f} "
                 f"min ({seconds:.0f} s: {'; '.join(terms)})")
    random = cfg.cost_mode.enabled or cfg.random_weights
    if not random:
        lines += ["inputs:"] + [f"  {line}" for line, _ in (
            input_status(what, ref) for what, ref in run_inputs(cfg))]
    lines.append("servers it would start (each command runs as printed; a run picks free "
                 "ports" + (", after writing the random weights)" if random else ")") + ":")
    return "\n".join(lines + server_lines(cfg, arms, gpus))
