"""ddtree-bench: DDTREE vs DFLASH vs no speculation in the real SGLang server, one GPU or many.

    ddtree-bench --config configs/h200_testbed.yaml --dry-run
    ddtree-bench --config configs/h200_testbed.yaml --out results/testbed
    ddtree-bench --config configs/h200_cost_qwen3_8b.yaml --out results/cost

Every arm runs with the same settings (attention backend, CUDA graphs, page size, overlap,
memory fraction) as one single-GPU server per entry of `gpus` (CUDA_VISIBLE_DEVICES), requests
spread round-robin, through the OpenAI endpoint (`endpoint: openai`, the default) or SGLang's
/generate (`endpoint: native`).  For each concurrency level (per replica) it records output
tokens/s, TPOT p50/p90, TTFT p50 and the accept length; at temperature 0 it compares every arm's outputs
with the no-speculation arm (run last, so its server can score divergences).  Writes
results.json, results.md and PNG plots to --out.  Servers are stopped on success, failure and
Ctrl-C.  With `cost_mode.enabled` it instead measures per-step cost on random Qwen3-8B-shaped
weights and writes a projected-speedup table.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from contextlib import ExitStack, closing
from pathlib import Path

from pydantic import ValidationError

from ddtree_bench import cells, client, compare, cost_mode, host_sampler, profile, report
from ddtree_bench.config import (DATASETS, Arm, BenchConfig, ConfigError, describe_errors,
                                        load_config, replica_gpus)
from ddtree_bench.server import Server, ServerSpec, stop_servers_on_sigterm
from ddtree_sglang.cli import (CliError, Parser, index_list, positive_int,
                              positive_int_list, run)
from ddtree_sglang.dflash.files import names_hub_repo
from ddtree_sglang.reference.testbed import encode_prompt, read_prompts


def load_prompts(cfg: BenchConfig) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_ref(cfg.model_path))
    src = cfg.prompts.source
    if src.endswith(".jsonl"):
        rows = read_prompts(_abs(src))
    else:  # needs network for the first download
        import datasets

        name, subset, split, field = DATASETS[src]
        ds = datasets.load_dataset(name, subset, split=split)
        rows = [dict(kind="chat", messages=[dict(role="user", content=r[field])]) for r in ds]
    return [encode_prompt(tok, r) for r in rows[: cfg.prompts.limit]]


def _abs(p: str) -> str:
    """Config paths are relative to the directory the benchmark is started from."""
    return str(Path(p).resolve())


def model_ref(p: str) -> str:
    """A config's model as the servers get it: a hub ID stays one (SGLang resolves it through
    the Hugging Face cache) unless a local folder of that name exists; a path is made absolute."""
    return p if names_hub_repo(p) else _abs(p)


def input_status(what: str, ref: str) -> tuple[str, str | None]:
    """(what a run would read or download for `ref`, the problem that stops a real run or
    None), without the network: a hub ID is looked up in the local cache only."""
    if ref in DATASETS:
        name = DATASETS[ref][0]
        return f"{what} {ref}: the {name} dataset, downloaded by `datasets` on first use", None
    if names_hub_repo(ref):
        from huggingface_hub import constants, try_to_load_from_cache

        cached = try_to_load_from_cache(ref, "config.json")
        if isinstance(cached, str):
            return f"{what} {ref}: hub ID, in the Hugging Face cache ({Path(cached).parent})", None
        if constants.HF_HUB_OFFLINE:
            return (f"{what} {ref}: hub ID, not in the Hugging Face cache",
                    f"{what} {ref} is not in the Hugging Face cache {constants.HF_HUB_CACHE} and "
                    f"HF_HUB_OFFLINE is set; fetch it first: hf download {ref}")
        return f"{what} {ref}: hub ID, not cached: the server downloads it at start", None
    path = Path(ref)
    if path.exists():
        return f"{what} {ref}: read from {path.resolve()}", None
    hint = (f"relative paths are read from {Path.cwd()}; run from the repository root"
            if not path.is_absolute() else "check the path")
    return (f"{what} {ref}: NOT FOUND here",
            f"{what} {ref} not found ({hint}, or name a Hugging Face hub ID such as "
            "Qwen/Qwen3-8B)")


def server_spec(cfg: BenchConfig, arm: Arm, model: str, drafter: str, extra=()) -> ServerSpec:
    return ServerSpec(
        model_path=model, name=arm.name, algorithm=arm.algorithm,
        draft_model_path=drafter if arm.algorithm else None,
        num_draft_tokens=(arm.budget + 1) if arm.algorithm == "DDTREE" and arm.budget else None,
        attention_backend=arm.attention_backend or cfg.attention_backend, dtype=cfg.dtype,
        mem_fraction_static=cfg.mem_fraction_static, cuda_graph_max_bs=cfg.cuda_graph_max_bs,
        disable_overlap_schedule=cfg.disable_overlap_schedule,
        page_size=arm.page_size or cfg.page_size, tp_size=arm.tp,
        max_running_requests=max(cfg.cuda_graph_max_bs, *cfg.concurrency, *cfg.profile.batches),
        max_total_tokens=cfg.max_total_tokens, sleep_on_idle=cfg.startup_group > 1,
        extra_args=list(extra), launcher_module=cfg.launcher_module,
        env=arm_env(arm) | ({host_sampler.ENV: "1"} if cfg.profile.host_samples else {}))


def arm_env(arm: Arm) -> dict[str, str]:
    """The arm's server env: a DDTREE arm with a budget verifies it every step unless its env
    asks for the batch-aware choice (SGLANG_DDTREE_BUDGETS=auto or a list); one without a
    budget keeps the shipped defaults; `simulate_accept` is SGLang's SGLANG_SIMULATE_ACC_LEN,
    or DDTREE's SGLANG_DDTREE_SIMULATE_ACC where it is a curve over budgets."""
    env = dict(arm.env)
    if isinstance(arm.simulate_accept, dict):
        from ddtree_sglang.sglang_plugin.settings import SIMULATE_ENV

        env[SIMULATE_ENV] = ",".join(f"{b}:{t}" for b, t in sorted(arm.simulate_accept.items()))
    elif arm.simulate_accept is not None:
        env["SGLANG_SIMULATE_ACC_LEN"] = str(arm.simulate_accept)
    if arm.algorithm != "DDTREE" or arm.budget is None:
        return env
    from ddtree_sglang.sglang_plugin.settings import BUDGETS_ENV

    return {BUDGETS_ENV: "off", **env}


def random_inputs(cfg: BenchConfig) -> tuple[str, str, list[list[int]]]:
    """The cost mode's random pair (written once) and prompts of random token ids."""
    cm = cfg.cost_mode
    target, drafter = cost_mode.write_random_models(cm.workdir)
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 150000) for _ in range(cm.prompt_len)]
               for _ in range(cfg.prompts.limit)]
    return str(target), str(drafter), prompts


def launch_replicas(stack: ExitStack, cfg: BenchConfig, spec: ServerSpec, out: Path) -> list[Server]:
    """One server per group of spec.tp_size entries of cfg.gpus, launched (not awaited); all
    stop when `stack` closes."""
    servers = [Server(spec, out / "logs" / f"{spec.name}_r{i}_gpu{g.replace(',', '-')}.log",
                      gpu=g) for i, g in enumerate(replica_gpus(cfg.gpus, spec.tp_size))]
    for s in servers:
        s.launch()
        stack.callback(s.stop)
    return servers


def started_groups(cfg: BenchConfig, arms: list[Arm], spec_of, out: Path):
    """Yield, per group of `cfg.startup_group` arms launched together (their kernel compilation
    and graph capture overlap), the list of (arm, servers, error): every server healthy, or
    None with the error.  The group's servers stay up until the next group is asked for."""
    g = cfg.startup_group
    for i in range(0, len(arms), g):
        with ExitStack() as stack:
            group = [(arm, launch_replicas(stack, cfg, spec_of(arm), out)) for arm in arms[i:i + g]]
            errors = {}
            for arm, servers in group:  # all healthy before any is measured: no capture beside it
                try:
                    for s in servers:
                        s.wait_healthy(cfg.startup_timeout_s)
                except Exception as exc:  # noqa: BLE001 - the other arms still run
                    errors[arm.name] = f"{type(exc).__name__}: {str(exc)[-800:]}"
                    for s in servers:
                        s.stop()
            yield [(arm, None, errors[arm.name]) if arm.name in errors else (arm, servers, None)
                   for arm, servers in group]


def started_arms(cfg: BenchConfig, arms: list[Arm], spec_of, out: Path):
    """Yield (arm, servers, error) in order (started_groups); each arm is measured alone and
    its servers stop before the next arm is yielded."""
    groups = started_groups(cfg, arms, spec_of, out)
    with closing(groups):
        for group in groups:
            for arm, servers, error in group:
                yield arm, servers, error
                for s in servers or ():
                    s.stop()


def run_throughput(cfg: BenchConfig, out: Path, command: str, save=None) -> dict:
    """Every arm, every concurrency level; `save(results)` is called after each level (a run
    cut short keeps what it measured).  Per group of arms started together and per level, the
    arms are measured in rounds with `cfg.interleave` (cells.measure_interleaved), else each
    arm's whole cell in turn."""
    params = dict(temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens, ignore_eos=True)
    extra: list[str] = []
    if cfg.random_weights:
        model, drafter, prompts = random_inputs(cfg)
        extra = ["--skip-tokenizer-init"]
    else:
        prompts = load_prompts(cfg)
        model, drafter = model_ref(cfg.model_path), model_ref(cfg.draft_model_path)
    ref = next((a for a in cfg.arms if a.algorithm is None), None)
    order = [a for a in cfg.arms if a is not ref] + ([ref] if ref else [])
    rows, outputs, failures, correctness = [], {}, {}, {}
    results = dict(meta=_meta(cfg, command, ref.name if ref else None), rows=rows,
                   correctness=correctness, failures=failures)
    groups = started_groups(cfg, order, lambda a: server_spec(cfg, a, model, drafter, extra),
                            out)
    sizes: dict[int, int] = {}
    with closing(groups):
        for group in groups:
            failures.update({arm.name: error for arm, _, error in group if error})
            live = [(arm, [s.url for s in servers], [s.log_path for s in servers])
                    for arm, servers, error in group if not error]
            first = len(rows)

            def level_done(measured: list[tuple[Arm, list, dict]]) -> None:
                for arm, res, row in measured:
                    rows.append(row)
                    greedy = outputs.setdefault(arm.name, {})
                    for r in res:
                        if r.error is None:
                            greedy.setdefault(r.prompt_index, r.output_ids)
                if save:
                    save(results)

            measure_group(cfg, live, prompts, params, level_done, sizes)
            for arm, urls, _ in live:
                profile_arm(cfg, arm, urls, prompts, results, out)
            rank = {arm.name: i for i, (arm, _, _) in enumerate(live)}
            rows[first:] = sorted(rows[first:], key=lambda r: rank[r["arm"]])  # arm by arm
            if ref is not None and cfg.temperature == 0 and ref.name in rank:
                url = next(urls[0] for arm, urls, _ in live if arm is ref)
                for other, outs in outputs.items():
                    if other != ref.name:
                        correctness[other] = compare.compare_to_reference(
                            prompts, outs, outputs[ref.name], url)
            for _, servers, _ in group:
                for s in servers or ():
                    s.stop()
            if save:
                save(results)
    return results


def measure_group(cfg: BenchConfig, live: list[tuple[Arm, list[str], list[Path]]], prompts,
                  params, level_done, sizes: dict[int, int] | None = None) -> None:
    """Every (arm, concurrency) cell of the arms whose servers are up ([(arm, urls, server
    logs)]), level by level: `level_done([(arm, results, row)])` after each level.  In rounds
    with `cfg.interleave`, else each arm's cell in turn; either way every arm of a level serves
    the same request list (`sizes`: the list's length per level, kept across groups)."""
    from tqdm import tqdm

    sizes = {} if sizes is None else sizes
    for arm, urls, _ in live:  # warm-up (JIT, graphs)
        client.run_level(urls, prompts, params, 2, 2 * len(urls), endpoint=cfg.endpoint)
    for conc in cfg.concurrency:
        if cfg.interleave:
            cells_at = cells.measure_interleaved(cfg, live, prompts, params, conc)
        else:
            if conc not in sizes:  # sized by the first arm measured at this level
                sizes[conc] = cells.cell_requests(cfg, live[:1], prompts, params, conc)
            cells_at = [cells.measure_cell(cfg, urls, prompts, params, arm, conc, tqdm, logs,
                                           n=sizes[conc])
                        for arm, urls, logs in live]
        measured = []
        for (arm, urls, _), (res, row) in zip(live, cells_at):
            if arm.algorithm and row["accept_length"] is None:  # OpenAI endpoint
                acc = [a for a in map(client.server_accept_length, urls) if a is not None]
                row["accept_length"] = round(sum(acc) / len(acc), 3) if acc else None
            measured.append((arm, res, row))
            print(f"{arm.name:<24} c={conc:<3} {row['requests']:>5} requests, median "
                  f"{row['output_tok_s']} tok/s, accept {row['accept_length']}", flush=True)
        level_done(measured)


cell_done = cells.cell_done  # the cell minimum (tests and callers read it here)
requests_for = cells.requests_for


def cost_arms(cfg: BenchConfig) -> list[Arm]:
    env = cfg.cost_mode.env
    dflash = [Arm(name="dflash", algorithm="DFLASH")] + [
        Arm(name=f"dflash-{b}", algorithm="DFLASH", attention_backend=b)
        for b in cfg.cost_mode.dflash_attention_backends if b != cfg.attention_backend]
    default = [Arm(name="ddtree-default", algorithm="DDTREE", env=env)] \
        if cfg.cost_mode.ddtree_default else []
    return [Arm(name="no-spec"), *dflash, *default] + [
        Arm(name=f"ddtree-b{b}", algorithm="DDTREE", budget=b, env=env)
        for b in cfg.cost_mode.budgets] + [
        Arm(name=f"ddtree-b{b}-single", algorithm="DDTREE", budget=b,
            env={**env, "SGLANG_DDTREE_DEBUG": "sglang_attention"})
        for b in cfg.cost_mode.single_attention_budgets]


def run_cost_mode(cfg: BenchConfig, out: Path, command: str, only: list[str] | None = None,
                  save=None) -> dict:
    cm = cfg.cost_mode
    target, drafter = cost_mode.write_random_models(cm.workdir)
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 150000) for _ in range(cm.prompt_len)] for _ in range(64)]
    params = dict(temperature=0.0, max_new_tokens=cm.new_tokens, ignore_eos=True)
    order = [a for a in cost_arms(cfg) if only is None or a.name in only]
    rows, failures = [], {}
    results = dict(meta=_meta(cfg, command, "no-spec"), cost_rows=[], failures=failures)
    one_gpu = cfg.model_copy(update=dict(gpus=cfg.gpus[:1]))
    spec_of = lambda a: server_spec(cfg, a, str(target), str(drafter),  # noqa: E731
                                    extra=["--skip-tokenizer-init"])
    arms = started_arms(one_gpu, order, spec_of, out)
    with closing(arms):
        for arm, servers, error in arms:
            if error:
                failures[arm.name] = error
                continue
            url = [servers[0].url]
            client.run_level(url, prompts, params, 2, 2)
            for bs in cm.batch_sizes:
                runs = [client.run_level(url, prompts, params, bs, bs)[0] for _ in range(cm.repeats)]
                row = dict(arm=arm.name, algorithm=arm.algorithm, budget=arm.budget,
                           batch_size=bs, **cost_mode.repeated_step_ms(runs),
                           errors=sum(r.error is not None for res in runs for r in res))
                rows.append(row)
                print(json.dumps(row), flush=True)
            profile_arm(cfg, arm, url, prompts, results, out)
            results["cost_rows"] = cost_mode.projection(rows)
            if save:
                save(results)
    results["cost_rows"] = cost_mode.projection(rows)
    return results


def profile_arm(cfg: BenchConfig, arm: Arm, urls: list[str], prompts, results: dict,
                out: Path) -> None:
    """Profile one arm's decode steps at every batch of cfg.profile into results["profiles"]
    ("arm@batch"); a failed profile is recorded in results["failures"], the run goes on."""
    for bs in cfg.profile.batches:
        key = f"{arm.name}@{bs}"
        try:
            results.setdefault("profiles", {})[key] = profile_level(
                urls[:1], prompts, cfg.profile, bs, out / "traces" / key)
        except Exception as exc:  # noqa: BLE001 - a failed profile is reported, not fatal
            results["failures"][f"profile {key}"] = f"{type(exc).__name__}: {exc}"[:300]


def profile_level(url: list[str], prompts, prof, bs: int, trace_dir: Path) -> dict:
    """`bs` long requests in flight, `prof.steps` decode steps profiled once every request
    streams (bench/profile.py), reduced to a kernel table; with `prof.launches` a second
    profile records the host too, for the launches per step (its timings are not used: the
    host's recording slows the step); with `prof.host_samples` a third samples the
    scheduler's Python stack over `prof.host_steps` steps (the table's "host")."""
    params = dict(temperature=0.0, max_new_tokens=prof.new_tokens, ignore_eos=True)
    events = profile.profile_under_load(url[0], prompts, params, bs, trace_dir / "gpu",
                                        prof.steps, ["GPU"])
    table = profile.kernel_table(events, prof.steps)
    if prof.launches:
        events = profile.profile_under_load(url[0], prompts, params, bs, trace_dir / "cpu",
                                            prof.steps, ["CPU", "GPU"])
        table["launches"] = profile.launch_counts(events, prof.steps)
        table["host_waits"] = profile.host_waits(events, prof.steps)
    if prof.host_samples:
        try:
            table["host"] = profile.host_profile(url[0], prompts, params, bs,
                                                 trace_dir / "host", prof.host_steps)
        except Exception as exc:  # noqa: BLE001 - the kernel table stands without it
            table["host_error"] = f"{type(exc).__name__}: {exc}"[:400]
    print(f"profile {trace_dir.name}: span {table['span_ms']} ms, idle {table['idle_ms']} ms, "
          f"launches {table.get('launches')}", flush=True)
    return table


def merge_results(a: dict, b: dict) -> dict:
    """`a` plus the cells of `b` (a cell = arm x batch size or concurrency; cells measured in
    both keep `a`'s row), so a run split over calls by arms or by levels becomes one table;
    each row of `b` is tagged with `b`'s command.  The projection is recomputed over all cost
    rows."""
    key = "cost_rows" if "cost_rows" in a else "rows"
    level = "batch_size" if key == "cost_rows" else "concurrency"
    have = {(r["arm"], r.get(level)) for r in a[key]}
    rows = a[key] + [dict(r, call=r.get("call", b["meta"]["command"])) for r in b.get(key, [])
                     if (r["arm"], r.get(level)) not in have]
    out = dict(a, **{key: cost_mode.projection(rows) if key == "cost_rows" else rows})
    measured = {r["arm"] for r in rows}
    out["failures"] = {k: v for k, v in {**b.get("failures", {}), **a.get("failures", {})}.items()
                       if k not in measured}
    if "correctness" in a:
        out["correctness"] = {**b.get("correctness", {}), **a["correctness"]}
    out["meta"] = dict(a["meta"], merged_from=[*a["meta"].get("merged_from", []),
                                               dict(command=b["meta"]["command"],
                                                    commit=b["meta"].get("commit"))])
    return out


def write(results: dict, out: Path) -> str:
    """results.json and results.md (also after each arm, so a cut-short run keeps its data)."""
    (out / "results.json").write_text(json.dumps(results, indent=1))
    md = cost_mode.markdown(results) if "cost_rows" in results else report.markdown(results)
    (out / "results.md").write_text(md)
    if results.get("profiles"):
        m = results["meta"]
        (out / "profile.md").write_text(profile.markdown(
            results["profiles"], f"# Decode-step GPU profile, {m['device']}, {m['date']}\n\n"
            f"Command: `{m['command']}`, commit `{m.get('commit', '?')}`. Torch profiler through "
            "SGLang's /start_profile, `batch` requests in flight, profiled once every one "
            "streams; timings from a GPU-only recording, launches and host waits from a second "
            "one with the host's activity; cells are arm@batch."))
    return md


def device_name() -> str:
    """The GPU's name (the first visible), "cpu" without one, "unknown" without torch."""
    try:
        import torch

        return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    except ImportError:
        return "unknown"


def commit_id() -> str:
    """The checkout's commit: DDTREE_COMMIT where the GPU machine's copy has no .git."""
    commit = os.environ.get("DDTREE_COMMIT")
    try:
        return commit or subprocess.run(
            ["git", "describe", "--always", "--dirty", "--abbrev=7"], cwd=Path.cwd(),
            capture_output=True, text=True).stdout.strip() or "?"
    except OSError:
        return "?"


def _meta(cfg: BenchConfig, command: str, reference: str | None) -> dict:
    return dict(name=cfg.name, device=device_name(), date=time.strftime("%Y-%m-%d"),
                commit=commit_id(), command=command, replicas=len(cfg.gpus), gpus=cfg.gpus,
                max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                reference_arm=reference, config=cfg.model_dump())


PROG = "ddtree-bench"


def main(argv: list[str] | None = None) -> int:
    return run(lambda: _main(argv), PROG)


def run_inputs(cfg: BenchConfig) -> list[tuple[str, str]]:
    """(role, reference) of what a run reads: the target, the drafter (when an arm
    speculates) and the prompts."""
    return [("target", cfg.model_path),
            *([("drafter", cfg.draft_model_path)] if any(a.algorithm for a in cfg.arms) else []),
            ("prompts", cfg.prompts.source)]


def missing_inputs(cfg: BenchConfig) -> list[str]:
    """Why a real run could not read its inputs: a local path that does not exist, a hub ID
    that is not cached while offline (cost mode writes its own models)."""
    if cfg.cost_mode.enabled or cfg.random_weights:
        return []
    return [problem for _, problem in (input_status(w, r) for w, r in run_inputs(cfg))
            if problem]


def gpu_problem(cfg: BenchConfig) -> str | None:
    """Why the servers could not run here (no CUDA GPU, or fewer GPUs than `gpus` names), or
    None.  Only for SGLang itself: a stand-in launcher (tests) needs no GPU."""
    if cfg.launcher_module != "sglang.launch_server":
        return None
    try:
        import torch
    except ImportError:
        return "PyTorch is not installed"
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    needed = max(cfg.gpus[:1] if cfg.cost_mode.enabled else cfg.gpus) + 1
    if count >= needed:
        return None
    return (f"the config's servers need {needed} CUDA GPU(s) (gpus: {cfg.gpus}); this machine "
            f"has {count}" + ("" if count else " (no usable CUDA GPU)"))


def _main(argv: list[str] | None) -> int:
    ap = Parser(prog=PROG, description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="configs/*.yaml")
    ap.add_argument("--out", type=Path, help="results folder (not needed with --dry-run)")
    ap.add_argument("--concurrency", type=positive_int_list, help="override, e.g. 1,4,16")
    ap.add_argument("--gpus", type=index_list, help="override the replica GPUs, e.g. 0,1,2,3")
    ap.add_argument("--cuda-graph-max-bs", type=positive_int,
                    help="override: capture decode / verify graphs only up to this batch size "
                         "(a call that measures only low concurrency starts faster)")
    ap.add_argument("--arms", help="only these arm names, e.g. no-spec,ddtree-b32")
    ap.add_argument("--dry-run", action="store_true",
                    help="validate the config and print the plan; start nothing")
    ap.add_argument("--report-only", action="store_true", help="re-render results.json")
    ap.add_argument("--merge-from", type=Path, action="append", default=[], metavar="DIR",
                    help="with --report-only: add the arms of DIR/results.json (runs split over "
                         "several calls, e.g. with --arms) before rendering")
    args = ap.parse_args(argv)
    try:
        cfg = load_config(args.config)
        updates = {}
        if args.concurrency:
            updates["concurrency"] = args.concurrency
        if args.gpus:
            updates["gpus"] = args.gpus
        if args.cuda_graph_max_bs:
            updates["cuda_graph_max_bs"] = args.cuda_graph_max_bs
        keep = args.arms.split(",") if args.arms else None
        if keep:
            names = [a.name for a in (cost_arms(cfg) if cfg.cost_mode.enabled else cfg.arms)]
            unknown = set(keep) - set(names)
            if unknown:
                raise CliError(f"unknown arms {sorted(unknown)}; this config has {names}")
            if not cfg.cost_mode.enabled:
                updates["arms"] = [a for a in cfg.arms if a.name in keep]
        cfg = BenchConfig(**{**cfg.model_dump(), **updates})
    except ConfigError as exc:
        raise CliError(str(exc)) from None
    except ValidationError as exc:
        raise CliError(f"after the command-line overrides: {describe_errors(exc)}") from None
    if args.dry_run:  # on any machine: what is missing here is named in the plan
        from ddtree_bench.dry_run import plan

        print(plan(cfg, keep))
        return 0
    absent = missing_inputs(cfg)
    if absent and not args.report_only:
        raise CliError("; ".join(absent))
    if args.out is None:
        raise CliError("--out is required (the results folder), except with --dry-run")
    if args.merge_from and not args.report_only:
        raise CliError("--merge-from needs --report-only")
    missing = [str(d / "results.json") for d in [args.out, *args.merge_from]
               if args.report_only and not (d / "results.json").is_file()]
    if missing:
        raise CliError(f"--report-only reads results.json from --out and each --merge-from "
                     f"folder; missing: {', '.join(missing)}")
    why = None if args.report_only else gpu_problem(cfg)
    if why:
        raise CliError(f"{why}; nothing was started (--dry-run shows the plan on any machine)")
    args.out.mkdir(parents=True, exist_ok=True)
    stop_servers_on_sigterm()
    command = f"{PROG} " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.report_only:
        results = json.loads((args.out / "results.json").read_text())
        for d in args.merge_from:
            results = merge_results(results, json.loads((d / "results.json").read_text()))
    elif cfg.cost_mode.enabled:
        results = run_cost_mode(cfg, args.out, command, keep, save=lambda r: write(r, args.out))
    else:
        results = run_throughput(cfg, args.out, command, save=lambda r: write(r, args.out))
    md = write(results, args.out)
    if results.get("rows"):
        report.plots(results, args.out)
    print(md)
    return 1 if results.get("failures") else 0
