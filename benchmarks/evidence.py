"""The evidence plan's runner and report (configs/evidence.yaml; bench/evidence.py says how slices
add up).

    python benchmarks/evidence.py next                 # what the next call would run (any machine)
    bash scripts/gpu_run.sh evidence                   # run the next slices (GPU, one device call)
    python benchmarks/evidence.py adopt DIR            # file a call's returned slices for commit
    python benchmarks/evidence.py report               # the combined table and plot, from commits

`run` takes the plan's slices in order that still lack committed results, as many as fit its time
(`--seconds`, the device call's 540 s less what the call spent before it), and writes each to
OUT/<slice id>/<date>_<card>_<n>/: slice.json, slice.md and logs.tgz (three files a slice, at
most two slices a call: a device call returns eight files).  Its log has one line per
measurement (arm, concurrency, round, requests, seconds, tok/s) and one per cell (its null and
ratios), no progress bars; it prints a short table last, and exits 1 when a slice it ran failed
(bench/evidence.py slice_failures: an arm that did not start, request errors, a traceback or a
leak in a server's log, ...; each named in slice.md with its first error line).

`adopt --note TEXT` records what the code that ran differed in from its commit (a stand-in
change made on the GPU machine) in every adopted slice.json; the report shows it beside the
commit.  Adopting a folder again is a no-op when its files are the same.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from ddtree_bench import evidence, run, slices  # noqa: E402
from ddtree_bench.config import ConfigError  # noqa: E402
from ddtree_bench.server_log import arm_of_log, log_problem  # noqa: E402
from ddtree_sglang.cli import CliError, Parser, positive_float  # noqa: E402
from ddtree_sglang.cli import run as run_cli  # noqa: E402

PLAN = ROOT / "configs" / "evidence.yaml"
RESULTS = ROOT / "benchmarks" / "results" / "evidence"
MAX_SLICES_PER_CALL = 2
LOG_TAIL_LINES = 3000


def _meta(s: evidence.SlicePlan, plan: evidence.EvidencePlan, levels: list[int]) -> dict:
    meta = dict(slice=s.id, item=s.item, what=s.what, date=time.strftime("%Y-%m-%d"),
                device=run.device_name(), commit=run.commit_id(),
                command="bash scripts/gpu_run.sh evidence", arms=s.arms, kinds=s.kinds,
                levels=levels, seconds=s.seconds or plan.seconds,
                rounds=s.rounds or plan.rounds, max_new_tokens=plan.max_new_tokens,
                phase=s.phase, env=s.env)
    if not s.phase:
        twin = evidence.slice_arms(plan, s)[-1].name
        meta.update(arms=[*s.arms, twin], work="fixed", shapes=s.shapes,
                    simulate=dict(s.simulate),
                    null=dict(arm=evidence.null_of(plan, s), twin=twin,
                              server=s.null_server))
    return meta


def _pack_logs(folder: Path, sources: list[Path]) -> None:
    """The last LOG_TAIL_LINES lines of every log under (or named by) `sources`, as
    folder/logs.tgz."""
    with tarfile.open(folder / "logs.tgz", "w:gz") as tar:
        for src in sources:
            for f in [src] if src.is_file() else sorted(p for p in src.rglob("*") if p.is_file()):
                if f.suffix in (".log", ".txt"):
                    tail = f.read_bytes().splitlines(keepends=True)[-LOG_TAIL_LINES:]
                    tmp = f.with_suffix(f.suffix + ".tail")
                    tmp.write_bytes(b"".join(tail))
                    tar.add(tmp, arcname=str(f.relative_to(src.parent)))
                    tmp.unlink()
                elif f.suffix in (".tgz", ".json", ".md"):
                    tar.add(f, arcname=str(f.relative_to(src.parent)))


def _server_logs(root: Path) -> Iterator[tuple[str, str]]:
    """(file name, text) of every log under `root`, loose or inside a .tgz (scripts/gpu_run.sh
    packs a phase's server logs into one)."""
    for f in sorted(p for p in root.rglob("*") if p.is_file()):
        if f.suffix == ".log":
            yield f.name, f.read_text(errors="replace")
        elif f.suffix == ".tgz":
            with tarfile.open(f) as tar:
                for m in tar.getmembers():
                    if m.isfile() and m.name.endswith(".log"):
                        yield Path(m.name).name, tar.extractfile(m).read().decode(errors="replace")


def log_errors(root: Path) -> dict[str, str]:
    """arm -> the first error line of its server log (a traceback's exception line, or a leak),
    for every server log under `root` that has one; read whole before the logs are cut to
    their tails, so the line that says why an arm failed reaches slice.json."""
    found: dict[str, str] = {}
    for name, text in _server_logs(root) if root.exists() else ():
        if (problem := log_problem(text)):
            found.setdefault(arm_of_log(name), problem)
    return found


def restore_hybrid_testbed() -> None:
    """testbed_hybrid/ travels without its generated weights: written and checked against its
    made_with.json before a server reads them (scripts/make_hybrid_testbed.py --restore)."""
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_hybrid_testbed.py"), "--source",
                    str(ROOT / "testbed"), "--out", str(ROOT / "testbed_hybrid"), "--restore"],
                   check=True)


def run_serving(plan, s, levels, folder: Path, stop_at: float) -> dict:
    cfg = evidence.slice_config(plan, s, ROOT, levels)
    results = dict(meta=_meta(s, plan, levels), rows=[], greedy_vs_plain={}, failures={})
    save = lambda: (folder / evidence.RESULT_FILE).write_text(json.dumps(results, indent=1))  # noqa: E731
    try:
        if s.shapes == "hybrid-testbed":
            restore_hybrid_testbed()
        slices.measure_slice(cfg, s.kinds, folder, results, save, stop_at=stop_at,
                             null=evidence.null_of(plan, s),
                             null_on_own_server=s.null_server == "same")
    except Exception as exc:  # noqa: BLE001 - a broken slice is recorded, the call goes on
        results["error"] = f"{type(exc).__name__}: {exc}"[:2000]
    results["log_errors"] = log_errors(folder / "logs")
    save()
    (folder / "slice.md").write_text(slices.markdown(results, evidence.failure_lines(results)))
    _pack_logs(folder, [folder / "logs"])
    shutil.rmtree(folder / "logs", ignore_errors=True)
    return results


def run_phase(plan, s, folder: Path, stop_at: float) -> dict:
    work = folder / "phase"
    limit = max(30, int(stop_at - time.monotonic()))
    env = dict(os.environ, OUT=str(work), LIMIT=str(limit), **s.env)
    with open(folder / "phase.log", "w") as log:
        rc = subprocess.run(["bash", "scripts/gpu_run.sh", s.phase], cwd=ROOT, env=env,
                            stdout=log, stderr=subprocess.STDOUT, timeout=limit + 30).returncode
    outputs = {}
    for f in sorted(work.rglob("*.json")) if work.exists() else []:
        if f.stat().st_size < 2_000_000:
            outputs[str(f.relative_to(work))] = json.loads(f.read_text())
    results = dict(meta=_meta(s, plan, []), rc=rc, outputs=outputs, log_errors=log_errors(work))
    (folder / evidence.RESULT_FILE).write_text(json.dumps(results, indent=1))
    tail = (folder / "phase.log").read_text().splitlines()[-60:]
    reports = [f.read_text() for f in sorted(work.rglob("*.md"))] if work.exists() else []
    (folder / "slice.md").write_text(f"# {s.id}: phase {s.phase}, exit {rc}\n\n"
                                     + "".join(x + "\n" for x in evidence.failure_lines(results))
                                     + "".join(r + "\n" for r in reports) + "```\n"
                                     + "\n".join(tail) + "\n```\n")
    _pack_logs(folder, [work, folder / "phase.log"] if work.exists() else [folder / "phase.log"])
    shutil.rmtree(work, ignore_errors=True)
    (folder / "phase.log").unlink()
    return results


def cmd_run(args) -> int:
    t0 = time.monotonic()
    stop_at = t0 + args.seconds
    plan = evidence.load_plan(args.plan)
    have = evidence.counts(evidence.read_slices(args.results))
    todo = evidence.next_slices(plan, have, run.device_name())
    if args.only:
        unknown = sorted(set(args.only) - {s.id for s in plan.slices})
        if unknown:
            raise CliError(f"--only: unknown slice(s) {', '.join(unknown)}; accepted: "
                           f"{', '.join(s.id for s in plan.slices)}")
        todo = [(s, lv) for s, lv in todo if s.id in args.only]
    from ddtree_bench.server import stop_servers_on_sigterm

    stop_servers_on_sigterm()
    done, cold = [], True
    for s, levels in todo:
        if len(done) == MAX_SLICES_PER_CALL:
            break
        left = stop_at - time.monotonic()
        need = evidence.estimate_seconds(plan, s, levels[:1] if not s.phase else levels)
        if not cold and not s.phase:
            need -= plan.startup_seconds / 2  # kernels compiled by the first slice
        if left < need:
            print(f"skip {s.id}: {left:.0f} s left, one level needs ~{need:.0f} s", flush=True)
            continue
        taken = [p.name for p in (args.results / s.id).glob("*")] + \
                [p.name for p in (args.out / s.id).glob("*")]
        folder = args.out / s.id / evidence.stamp(time.strftime("%Y-%m-%d"), run.device_name(), taken)
        folder.mkdir(parents=True)
        print(f"slice {s.id} -> {folder} (levels {levels})", flush=True)
        res = run_phase(plan, s, folder, stop_at) if s.phase else run_serving(
            plan, s, levels, folder, stop_at)
        done.append((s, folder, res))
        cold = False
    print(summary_table(done, time.monotonic() - t0))
    return 1 if any(evidence.slice_failures(res) for _, _, res in done) else 0


def summary_table(done, wall: float) -> str:
    """The call's table (a row per slice: cells, counted, null, failed arms), every failed
    arm's first error line under it, then each serving slice's own report."""
    lines = [f"evidence call: {len(done)} slice(s) in {wall:.0f} s", "",
             "| slice | folder | cells done | counted | null (worst) | skipped | failures | note |",
             "|---|---|---|---|---|---|---|---|"]
    for s, folder, res in done:
        failed = evidence.slice_failures(res)
        names = ", ".join(failed) or "-"
        if s.phase:
            lines.append(f"| {s.id} | {folder.parent.name}/{folder.name} | phase | "
                         f"{'yes' if evidence.counted_cells(res) else 'no'} | - | - | {names} | "
                         f"exit {res['rc']} |")
            continue
        cells_ = sorted(evidence.cells_of(res))
        counted = evidence.counted_cells(res)
        worst = (res.get("null") or {}).get("worst")
        lines.append(f"| {s.id} | {folder.parent.name}/{folder.name} | "
                     f"{', '.join(f'{k}@{c}' for k, c in cells_) or '-'} | "
                     f"{len(counted)} of {len(cells_)} | {'-' if worst is None else worst} | "
                     f"{len(res.get('cells_skipped', []))} | {names} | "
                     f"{res.get('error', '')[:80]} |")
    failed = [f"FAILED {s.id}: {arm}: {line}" for s, _, res in done
              for arm, line in evidence.slice_failures(res).items()]
    lines += ["", *failed] if failed else []
    for s, _, res in done:
        if not s.phase and res["rows"]:
            lines += ["", slices.markdown(res)]
    return "\n".join(lines)


def cmd_next(args) -> int:
    plan = evidence.load_plan(args.plan)
    have = evidence.counts(evidence.read_slices(args.results))
    todo = evidence.next_slices(plan, have)
    if not todo:
        print("every cell of the plan has its results")
        return 0
    for s, levels in todo:
        where = f"phase {s.phase}" if s.phase else f"c = {', '.join(map(str, levels))}"
        where += f", {s.card} only" if s.card else ""
        print(f"{s.id} (item {s.item}, {where}): ~{evidence.estimate_seconds(plan, s, levels):.0f}"
              f" s cold; {s.what}")
    return 0


def _files_of(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` by its relative path, with its bytes."""
    return {str(f.relative_to(folder)): f.read_bytes()
            for f in sorted(folder.rglob("*")) if f.is_file()}


def adopted_files(folder: Path, note: str | None) -> dict[str, bytes]:
    """A returned slice folder's files as adopted: copied as they are, or with `note` (what
    the code that ran differed in from its commit) in slice.json's meta and atop slice.md."""
    files = _files_of(folder)
    if note:
        data = json.loads(files[evidence.RESULT_FILE])
        data["meta"]["note"] = note
        files[evidence.RESULT_FILE] = json.dumps(data, indent=1).encode()
        if "slice.md" in files:
            files["slice.md"] = f"> Note (given at adoption): {note}\n\n".encode() + files["slice.md"]
    return files


def cmd_adopt(args) -> int:
    """Copy OUT/<slice id>/<stamp>/ folders of a returned call into the results tree (with
    --note recorded in each).  A folder adopted already with the same files is left as it is;
    one with other files refuses the whole batch before anything is written."""
    src = Path(args.dir)
    found = sorted(p.parent for p in src.glob(f"*/*/{evidence.RESULT_FILE}"))
    if not found:
        raise CliError(f"no <slice id>/<stamp>/{evidence.RESULT_FILE} under {src}")
    todo = [(args.results / f.parent.name / f.name, adopted_files(f, args.note)) for f in found]
    for dest, files in todo:
        if dest.exists() and _files_of(dest) != files:
            raise CliError(f"{dest} exists already with other files; not overwritten")
    for dest, files in todo:
        shown = dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest
        if dest.exists():
            print(f"adopted already: {shown}")
            continue
        for name, data in files.items():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            (dest / name).write_bytes(data)
        print(f"adopted {shown}")
    return cmd_report(args)


def cmd_report(args) -> int:
    plan = evidence.load_plan(args.plan)
    found = evidence.read_slices(args.results)
    args.results.mkdir(parents=True, exist_ok=True)
    md = evidence.report_markdown(plan, found)
    png = evidence.plot(plan, found, args.results / "evidence.png")
    if png:
        md += "\n![DDTREE / DFLASH per cell](evidence.png)\n"
    else:  # nothing to plot: no stale picture beside the report
        (args.results / "evidence.png").unlink(missing_ok=True)
    (args.results / "README.md").write_text(md)
    print(md)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = Parser(prog="evidence.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--plan", type=Path, default=PLAN)
    ap.add_argument("--results", type=Path, default=RESULTS,
                    help="the committed slices (default benchmarks/results/evidence)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run the next slices (GPU)")
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--seconds", type=positive_float, default=520.0,
                   help="this call's time for slices, from now (default 520)")
    r.add_argument("--only", type=lambda t: [x for x in t.split(",") if x], default=None,
                   help="comma list of slice ids: run only these (still only while wanted)")
    sub.add_parser("next", help="list the slices still wanted")
    a = sub.add_parser("adopt", help="file a call's returned slices under --results")
    a.add_argument("dir")
    a.add_argument("--note", default=None,
                   help="what the code that ran differed in from its commit (a stand-in "
                   "change): recorded in each slice.json, shown beside the commit")
    sub.add_parser("report", help="write the combined report and plot under --results")
    args = ap.parse_args(argv)

    def go() -> int:
        try:
            return dict(run=cmd_run, next=cmd_next, adopt=cmd_adopt, report=cmd_report)[
                args.cmd](args)
        except ConfigError as exc:
            raise CliError(str(exc)) from None

    return run_cli(go, "evidence.py")


if __name__ == "__main__":
    sys.exit(main())
