"""The evidence plan: GPU results collected in slices that add up across device calls, sessions
and cards (configs/evidence.yaml, `bash scripts/gpu_run.sh evidence`).

A *slice* is one plan entry measured in one device call: every arm of its cells on one machine,
interleaved, on fixed work (every arm serves the same request list), so its ratios (DDTREE /
DFLASH, / plain, the grammar tax) are paired time ratios.  Every serving slice carries a measured
null: its null arm (the shipped defaults, `ddtree-default`) runs on two servers started with the
others, and their ratio in a cell is that cell's noise.  Its result lands in
`<results>/<slice id>/<date>_<card>_<n>/slice.json`.

Each cell (slice id, grammar kind, concurrency) wants `slices_per_cell` results that count: a
slice's cell counts when every arm was measured there and its null lies within 0.95-1.05
(slices.NULL_BAND); a slice without a null (older ones) is shown but never counts.  The runner
takes the plan's slices in order, runs the levels whose cells still lack results, and stops
starting cells before its time limit, so a later call (on any card) continues where this one
stopped.  Slices combine only through their ratios: absolute tok/s never leave their slice.

Slices of kind `phase` run a GPU check or profile of scripts/gpu_run.sh (e2e, features, cost,
profile) as one cell; their result is the phase's files and exit code.

A slice that *failed* counts nothing, serving or phase alike (slice_failures): an arm that did
not start, request errors, a server whose log holds a traceback or a leak, one not alive at the
end, a phase's non-zero exit; each failed arm is named with its first error line.
"""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path
from typing import Literal, Optional, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ddtree_bench.config import Arm, BenchConfig, ConfigError, describe_errors
from ddtree_bench.grammars import kind_names
from ddtree_bench.server_log import first_error_line

RESULT_FILE = "slice.json"
PHASES = ("e2e", "features", "rel", "cost", "profile", "micro", "kernel")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SlicePlan(_Strict):
    """One slice: serving cells (arms x kinds x concurrency) or a scripts/gpu_run.sh phase."""

    id: str = Field(pattern=r"^[a-z0-9][a-z0-9_.-]*$")
    item: int = Field(ge=1, description="the issue's plan item it serves (order of value)")
    what: str = Field(description="one line: what the slice measures and why")
    arms: list[str] = []
    kinds: list[str] = ["none"]
    concurrency: list[int] = [1, 16, 64]
    seconds: Optional[float] = Field(None, gt=0, description="a measurement's time: the cell's "
                                     "request list is sized so the slowest arm needs about this")
    rounds: Optional[int] = Field(None, ge=1)
    null_arm: Optional[str] = Field(None, description="the arm served twice for the null "
                                    "(default: the plan's)")
    phase: Optional[Literal[PHASES]] = None
    env: dict[str, str] = Field({}, description="environment of a phase (its knobs)")
    phase_seconds: float = Field(300, gt=0, description="a phase's expected run time")
    shapes: Literal["testbed", "hybrid-testbed", "qwen3-8b"] = Field(
        "testbed", description="the testbed pair (greedy outputs checked against plain), the "
        "hybrid testbed (testbed_hybrid/: gated-delta layers, bfloat16, written on the machine "
        "and checked), or Qwen3-8B shapes: the cost mode's random-weight pair, random prompts, "
        "every speculative arm at a simulated acceptance (`simulate`)")
    card: Optional[str] = Field(None, description="run only on a card whose name holds this "
                                "(h100, h200): verdicts of different cards are separate slices")
    simulate: dict[str, Union[float, dict[int, float]]] = Field(
        {}, description="per arm, its forced acceptance (Arm.simulate_accept: one mean, or "
        "DDTREE's curve {budget: tau}); the null's twin takes its arm's")
    null_server: Literal["twin", "same"] = Field(
        "twin", description="the null: its arm on a second server (twin), or its own server "
        "measured twice in each round (same: where the card holds no further server)")
    mem_fraction_static: Optional[float] = Field(None, gt=0, lt=1)
    max_total_tokens: Optional[int] = Field(None, ge=1024, description="each server's KV pool "
                                            "(default: the plan's testbed size)")
    prompt_len: int = Field(512, ge=1, description="qwen3-8b: random prompt tokens")
    max_new_tokens: Optional[int] = Field(None, ge=2)
    startup_seconds: Optional[float] = Field(None, ge=0, description="this slice's servers to "
                                             "healthy on a cold machine (default: the plan's)")

    @model_validator(mode="after")
    def _shape(self) -> "SlicePlan":
        if self.phase is None and not self.arms:
            raise ValueError(f"slice {self.id}: serving slices need arms (or give a phase)")
        if self.phase is not None and (self.arms or self.null_arm):
            raise ValueError(f"slice {self.id}: a phase slice takes no arms and no null")
        unknown = sorted(set(self.simulate) - set(self.arms) - {self.null_arm})
        if unknown:
            raise ValueError(f"slice {self.id}: simulate names arm(s) {', '.join(unknown)} "
                             "not among its arms")
        kind_names(",".join(self.kinds))  # ValueError naming the accepted kinds
        if min(self.concurrency, default=0) < 1:
            raise ValueError(f"slice {self.id}: concurrency levels must be >= 1")
        return self


class EvidencePlan(_Strict):
    slices_per_cell: int = Field(2, ge=1, description="counted results each cell wants")
    call_seconds: float = Field(540, gt=60, description="one device call, startup included")
    startup_seconds: float = Field(200, ge=0, description="a slice's servers, cold machine")
    seconds: float = Field(6, gt=0, description="default time of a measurement (fixed work: "
                           "the slowest arm's, 4-8 s)")
    rounds: int = Field(2, ge=1, description="default interleaved rounds per cell")
    null_arm: str = Field("ddtree-default", description="the arm every serving slice serves "
                          "twice (two servers): the measured null")
    max_new_tokens: int = Field(128, ge=2)
    mem_fraction_static: float = Field(0.2, gt=0, lt=1)
    launcher_module: str = Field("sglang.launch_server", description="module run with -m to "
                                 "start a server (tests use a stand-in)")
    arms: dict[str, Arm] = Field(description="the arms slices name, by name")
    slices: list[SlicePlan]

    @model_validator(mode="after")
    def _names(self) -> "EvidencePlan":
        ids = [s.id for s in self.slices]
        if len(set(ids)) != len(ids):
            raise ValueError(f"slice ids must be unique; got {ids}")
        if self.null_arm not in self.arms:
            raise ValueError(f"null_arm: unknown arm {self.null_arm!r}; accepted: "
                             f"{', '.join(self.arms)}")
        for s in self.slices:
            unknown = [a for a in s.arms if a not in self.arms]
            if unknown:
                raise ValueError(f"slice {s.id}: unknown arm(s) {', '.join(unknown)}; "
                                 f"accepted: {', '.join(self.arms)}")
            if s.arms and s.shapes != "qwen3-8b" and "plain" not in s.arms:
                raise ValueError(f"slice {s.id}: needs the arm 'plain' (the greedy reference)")
            unforced = [a for a in s.arms if s.shapes == "qwen3-8b" and
                        self.arms[a].algorithm and a not in s.simulate]
            if unforced:
                raise ValueError(f"slice {s.id}: at Qwen3-8B shapes (random weights) every "
                                 f"speculative arm needs its acceptance in simulate; missing: "
                                 f"{', '.join(unforced)}")
            if s.arms and null_of(self, s) not in s.arms:
                raise ValueError(f"slice {s.id}: needs the arm {null_of(self, s)!r} (the null "
                                 "serves it twice); add it to arms")
        for name, arm in self.arms.items():
            if arm.name != name:
                raise ValueError(f"arm {name!r}: its name field says {arm.name!r}")
        return self


def null_of(plan: EvidencePlan, s: SlicePlan) -> str:
    """The arm a serving slice serves twice."""
    return s.null_arm or plan.null_arm


def load_plan(path: str | Path) -> EvidencePlan:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"evidence plan {p} not found")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"evidence plan {p}: not valid YAML ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"evidence plan {p}: expected a mapping (slices:, arms:, ...)")
    for name, arm in (data.get("arms") or {}).items():
        if isinstance(arm, dict):
            arm.setdefault("name", name)
    try:
        return EvidencePlan(**data)
    except ValidationError as exc:
        raise ConfigError(f"evidence plan {p}: {describe_errors(exc)}") from None


def _arm(plan: EvidencePlan, s: SlicePlan, name: str) -> Arm:
    """A plan arm with the slice's forced acceptance for it, if any."""
    arm = plan.arms[name]
    forced = s.simulate.get(name)
    return arm if forced is None else arm.model_copy(update=dict(simulate_accept=forced))


def slice_arms(plan: EvidencePlan, s: SlicePlan) -> list[Arm]:
    """A serving slice's measured arms: its own, then the null's twin (`<null>-null`: a
    server of its own, or with null_server "same" the null's server measured twice)."""
    from ddtree_bench.slices import null_twin

    return [_arm(plan, s, a) for a in s.arms] + [null_twin(_arm(plan, s, null_of(plan, s)))]


def slice_servers(plan: EvidencePlan, s: SlicePlan) -> list[Arm]:
    """The arms that get a server of their own (the twin only with null_server "twin")."""
    arms = slice_arms(plan, s)
    return arms if s.null_server == "twin" else arms[:-1]


def slice_config(plan: EvidencePlan, s: SlicePlan, root: Path,
                 levels: list[int] | None = None) -> BenchConfig:
    """The serving config of a slice (all its servers started together, interleaved, fixed
    work): the testbed pair, or at Qwen3-8B shapes the cost mode's random pair in bfloat16
    (its weights are bfloat16) with random prompts, each server's KV and graphs sized for the
    slice's highest concurrency."""
    arms = slice_servers(plan, s)
    eight_b = s.shapes == "qwen3-8b"
    pair = root / ("testbed_hybrid" if s.shapes == "hybrid-testbed" else "testbed")
    where = dict(random_weights=True, dtype="bfloat16", cost_mode=dict(prompt_len=s.prompt_len),
                 prompts=dict(limit=256)) if eight_b else dict(
        prompts=dict(source=str(root / "testbed" / "prompts.jsonl"), limit=32),
        model_path=str(pair / "target"), draft_model_path=str(pair / "drafter"),
        # gated-delta layers need bfloat16 in SGLang 0.5.17 (tests/gpu/e2e_server.py says why)
        dtype="bfloat16" if s.shapes == "hybrid-testbed" else "float16")
    return BenchConfig(
        name=f"evidence-{s.id}", arms=arms, concurrency=levels or s.concurrency,
        endpoint="native", mem_fraction_static=s.mem_fraction_static or plan.mem_fraction_static,
        cuda_graph_max_bs=max(s.concurrency) if eight_b else max(64, *s.concurrency),
        max_total_tokens=s.max_total_tokens or 262144, startup_group=len(arms),
        max_new_tokens=s.max_new_tokens or plan.max_new_tokens,
        temperature=0.0, cell_seconds=s.seconds or plan.seconds,
        launcher_module=plan.launcher_module, startup_timeout_s=900 if eight_b else 600,
        repeats=s.rounds or plan.rounds, warmup_per_cell=True, interleave=True, **where)


# -- committed results -------------------------------------------------------------------------

def read_slices(results: Path) -> list[dict]:
    """Every committed slice result under `results` (<id>/<stamp>/slice.json), oldest first,
    each with `folder` (relative to `results`) added."""
    found = []
    for f in sorted(results.glob(f"*/*/{RESULT_FILE}")):
        data = json.loads(f.read_text())
        data["folder"] = str(f.parent.relative_to(results))
        found.append(data)
    return found


def slice_null(result: dict) -> str | None:
    """The arm a serving slice served twice, None for slices without a null."""
    return (result["meta"].get("null") or {}).get("arm")


def cells_of(result: dict) -> set[tuple[str, int]]:
    """The (kind, concurrency) cells a slice result holds: every arm measured there."""
    if result["meta"].get("phase"):
        return {("phase", 0)} if result.get("rc") == 0 else set()
    arms = set(result["meta"]["arms"]) - set(result.get("failures", {}))
    by: dict[tuple[str, int], set[str]] = {}
    for r in result["rows"]:
        if r.get("rounds_tok_s"):
            by.setdefault((r["kind"], r["concurrency"]), set()).add(r["arm"])
    return {c for c, have in by.items() if have >= arms and "plain" in have}


def cell_rows(result: dict, kind: str, conc: int) -> list[dict]:
    return [r for r in result["rows"] if (r["kind"], r["concurrency"]) == (kind, conc)]


def _first_line(error: str) -> str:
    """An error text's line worth reading: its traceback's exception line, else its first."""
    return first_error_line(error) or next(iter(error.strip().splitlines()), "?")[:300]


def health_failure(rec: dict) -> tuple[str, None] | None:
    """A server's end-of-run flags as the GPU checks record them (e2e.json's arms,
    features.json's `health`): a traceback in its log, not alive at the end, a leak."""
    flags = [(rec.get("traceback_in_log"), "a traceback in its log"),
             (rec.get("alive_at_end", rec.get("alive")) is False, "not alive at the end"),
             (rec.get("leak_in_log"), "a leak in its log")]
    return next(((reason, None) for failed, reason in flags if failed), None)


def e2e_arm_failure(rec: dict) -> tuple[str, str | None] | None:
    """Why one arm of tests/gpu/e2e_server.py's e2e.json failed, as (reason, error text or
    None); None: it passed.  No `healthy_after_s`: its server never became healthy (its
    `error` says why); an `error` in its checks; greedy request errors; health_failure."""
    if rec.get("healthy_after_s") is None:
        return "did not start", rec.get("error")
    if rec.get("error"):
        return "failed its checks", rec["error"]
    if rec.get("greedy_errors"):
        return "request errors", str(rec["greedy_errors"][0])
    return health_failure(rec)


def e2e_unchecked(result: dict) -> list[str]:
    """The arms an e2e phase was asked for (its env's ARMS) that e2e.json holds no record of:
    the check stopped before them (a timeout; an error before the first arm, and no e2e.json).
    The phase's exit code does not say so (scripts/gpu_run.sh packs the logs after it)."""
    checked = {rec["arm"] for out in (result.get("outputs") or {}).values()
               if isinstance(out, dict) for rec in out.get("arms") or []
               if isinstance(rec, dict) and "arm" in rec}
    wanted = [a for a in (result["meta"].get("env") or {}).get("ARMS", "").split(",") if a]
    return [a for a in wanted if a not in checked]


def _row_failure(row: dict) -> tuple[str, str | None] | None:
    """A measured row's request errors (bench/client.py counts them and keeps the first)."""
    if not row.get("errors"):
        return None
    where = f"{row['kind']}@{row.get('concurrency')}" if "kind" in row else \
        f"c = {row.get('concurrency', row.get('batch_size'))}"
    return f"{row['errors']} request errors at {where}", row.get("first_error")


def slice_failures(result: dict) -> dict[str, str]:
    """Why a slice failed, by arm ("phase" / "runner" for the slice itself): the reason and
    the first error line, the arm's server log's where it has one (`log_errors`, read by the
    runner before it packs the logs), else the recorded error's; empty when it did not fail.
    Read from the slice's own record: a phase's exit code and outputs (e2e.json's arms, and
    every arm asked for among them; features.json's `health`; a serving run's `failures` and
    rows), a serving slice's
    `failures` (servers that did not start), rows with request errors, `not_alive_at_end`,
    the runner's `error`, and any server log with a traceback or a leak."""
    logged = result.get("log_errors") or {}
    found: dict[str, str] = {}

    def add(arm: str, reason: str, error: str | None = None) -> None:
        line = logged.get(arm) or (_first_line(error) if error else None)
        found.setdefault(arm, f"{reason}: {line}" if line else reason)

    if result["meta"].get("phase") and result.get("rc") != 0:
        add("phase", f"exit {result.get('rc')}")
    if result.get("error"):
        add("runner", "the slice stopped", result["error"])
    outputs = [o for o in (result.get("outputs") or {}).values() if isinstance(o, dict)]
    for out, reason in [(result, "did not start"), *((o, "failed") for o in outputs)]:
        for arm, error in (out.get("failures") or {}).items():
            add(arm, reason, str(error))
        for row in out.get("rows") or []:
            if isinstance(row, dict) and "arm" in row and (why := _row_failure(row)):
                add(row["arm"], *why)
        for rec in out.get("arms") or []:
            if isinstance(rec, dict) and "arm" in rec and (why := e2e_arm_failure(rec)):
                add(rec["arm"], *why)
        for arm, rec in (out.get("health") or {}).items():
            if isinstance(rec, dict) and (why := health_failure(rec)):
                add(arm, *why)
    for arm in e2e_unchecked(result) if result["meta"].get("phase") == "e2e" else []:
        add(arm, "not checked: the phase stopped before it")
    for arm in result.get("not_alive_at_end") or []:
        add(arm, "not alive at the end")
    for arm in logged:
        add(arm, "its server log")
    return found


def failure_lines(result: dict) -> list[str]:
    """Markdown lines for a failed slice (none for one that did not fail): each failed arm and
    its first error line, and that the slice counts nothing."""
    failed = slice_failures(result)
    if not failed:
        return []
    return ["**Failed: this slice counts nothing.**", ""] + [
        f"- `{arm}`: {line}" for arm, line in failed.items()] + [""]


def why_not_counted(result: dict, kind: str, conc: int) -> str | None:
    """Why a measured cell of a serving slice does not count (None: it counts): the slice
    failed, no null in the slice, its twin not measured, or its null outside the band."""
    from ddtree_bench.slices import NULL_BAND, null_ratio

    failed = slice_failures(result)
    if failed:
        arm, line = next(iter(failed.items()))
        return f"failed: {arm}: {line}"
    null = slice_null(result)
    if null is None:
        return "no null"
    q = null_ratio(cell_rows(result, kind, conc), null)
    if q is None:
        return "null not measured"
    if not q["quiet"]:
        return f"noisy: null {q['median']:.3f} outside {NULL_BAND[0]}-{NULL_BAND[1]}"
    return None


def counted_cells(result: dict) -> set[tuple[str, int]]:
    """The cells of a slice result that count toward the plan: none of a failed slice
    (slice_failures), nor of a run on a stand-in (adopted with a note: not the commit as
    committed, so the plan still owes that slice); a passed phase; a serving cell with every
    arm measured and its null within the band."""
    if slice_failures(result) or result["meta"].get("note"):
        return set()
    if result["meta"].get("phase"):
        return cells_of(result)
    return {c for c in cells_of(result) if why_not_counted(result, *c) is None}


def counts(results: list[dict]) -> dict[tuple[str, str, int], int]:
    """Counted results per cell: (slice id, kind, concurrency) -> count."""
    n: dict[tuple[str, str, int], int] = {}
    for r in results:
        for kind, conc in counted_cells(r):
            key = (r["meta"]["slice"], kind, conc)
            n[key] = n.get(key, 0) + 1
    return n


def pending_levels(plan: EvidencePlan, s: SlicePlan, have: dict) -> list[int]:
    """A serving slice's concurrency levels with a cell still short of results ([0] for a phase
    still wanted, [] when the slice is complete)."""
    want = plan.slices_per_cell
    if s.phase:
        return [0] if have.get((s.id, "phase", 0), 0) < want else []
    return [c for c in s.concurrency if any(have.get((s.id, k, c), 0) < want for k in s.kinds)]


def on_card(s: SlicePlan, device: str | None) -> bool:
    """Whether a slice runs on this card (None: any card, for listing)."""
    return device is None or s.card is None or s.card.lower() in device.lower()


def next_slices(plan: EvidencePlan, have: dict,
                device: str | None = None) -> list[tuple[SlicePlan, list[int]]]:
    """The slices still wanted (on `device`'s card, where given), in plan order, each with
    the levels to run."""
    return [(s, lv) for s in plan.slices
            if on_card(s, device) and (lv := pending_levels(plan, s, have))]


def estimate_seconds(plan: EvidencePlan, s: SlicePlan, levels: list[int]) -> float:
    """A slice's expected wall time on a cold machine: startup plus every cell (each arm and
    the null's twin: a probe, then every round at the slowest arm's time; an upper bound)."""
    if s.phase:
        return s.phase_seconds
    from ddtree_bench.cells import cell_estimate

    cfg = slice_config(plan, s, Path("."), levels)
    startup = plan.startup_seconds if s.startup_seconds is None else s.startup_seconds
    return startup + cell_estimate(cfg, len(slice_arms(plan, s))) * len(levels) * len(s.kinds)


def stamp(date: str, device: str, taken: list[str]) -> str:
    """A result folder's name: date, card (letters and digits) and a serial, unique in `taken`."""
    card = re.sub(r"[^a-z0-9]+", "", device.lower().replace("nvidia", "")) or "cpu"
    n = 1
    while f"{date}_{card}_{n}" in taken:
        n += 1
    return f"{date}_{card}_{n}"


# -- the combined report -----------------------------------------------------------------------

def slice_cells(results: list[dict]) -> list[dict]:
    """One record per (slice result, kind, concurrency, arm other than plain and the null's
    twin): the ratios measured inside that slice (to DFLASH, to plain: time ratios; the grammar
    tax beside DFLASH's), accept lengths, the cell's null, and whether it counts (and why
    not)."""
    from ddtree_bench.slices import grammar_tax, is_twin, null_ratio, ratio_to

    out = []
    for res in results:
        if res["meta"].get("phase"):
            continue
        sid, rows, null = res["meta"]["slice"], res["rows"], slice_null(res)
        for kind, conc in sorted(cells_of(res)):
            cell = cell_rows(res, kind, conc)
            q = null_ratio(cell, null) if null else None
            why = why_not_counted(res, kind, conc)
            d = next((x for x in cell if x["arm"] == "dflash"), None)
            for r in cell:
                if r["arm"] == "plain" or is_twin(r["arm"]):
                    continue
                rec = dict(slice=sid, kind=kind, concurrency=conc, arm=r["arm"],
                           folder=res["folder"], card=res["meta"]["device"],
                           null=q["median"] if q else None, counts=why is None, why=why,
                           accept=r.get("accept_length"),
                           accept_dflash=d.get("accept_length") if d else None,
                           tax=None, tax_dflash=None)
                for key, base in (("x_dflash", "dflash"), ("x_plain", "plain")):
                    ratio = ratio_to(cell, r["arm"], base) if r["arm"] != base else None
                    rec[key] = ratio["median"] if ratio else None
                if kind != "none":
                    t, td = grammar_tax(rows, r["arm"], kind, conc), grammar_tax(
                        rows, "dflash", kind, conc)
                    if t and td:
                        rec["tax"], rec["tax_dflash"] = round(t, 3), round(td, 3)
                out.append(rec)
    return out


def combined_cells(plan: EvidencePlan, results: list[dict]) -> list[dict]:
    """Per (slice, kind, concurrency, arm): the counted slices' ratios, in lists (their median
    and range make the report's cell), with each slice's null, card and folder."""
    acc: dict[tuple, dict] = {}
    keys = ("x_dflash", "x_plain", "tax", "tax_dflash", "accept", "accept_dflash")
    for rec in slice_cells(results):
        if not rec["counts"]:
            continue
        e = acc.setdefault((rec["slice"], rec["kind"], rec["concurrency"], rec["arm"]), dict(
            slice=rec["slice"], kind=rec["kind"], concurrency=rec["concurrency"],
            arm=rec["arm"], nulls=[], cards=[], folders=[], **{k: [] for k in keys}))
        for k in keys:
            if rec[k] is not None:
                e[k].append(rec[k])
        e["nulls"].append(rec["null"])
        e["cards"].append(rec["card"])
        e["folders"].append(rec["folder"])
    return list(acc.values())


def _summary(xs: list[float]) -> str:
    if not xs:
        return "-"
    med = statistics.median(xs)
    return f"{med:.2f}" if len(xs) == 1 else f"{med:.2f} [{min(xs):.2f}-{max(xs):.2f}]"


def _num(x: float | None, fmt: str = ".2f") -> str:
    return "-" if x is None else format(x, fmt)


def report_markdown(plan: EvidencePlan, results: list[dict], link_prefix: str = "") -> str:
    """The report over all committed slices: per cell the median ratio over the slices that
    count, its range, their nulls, accept lengths and cards; the measured cells that do not
    count and why; the phases' results and profiles; what is still pending."""
    from ddtree_bench.slices import NULL_BAND

    have = counts(results)
    lines = ["# Evidence: every committed slice, combined", "",
             "Generated by `python benchmarks/evidence.py report` from the slices below "
             "(configs/evidence.yaml). Every arm of a cell serves the same requests (fixed "
             "work); a ratio is measured inside one slice (paired interleaved rounds, median of "
             "the per-round time ratios); across slices the table gives the median of the "
             "slices' ratios [min-max] and n slices. A slice's cell counts only if its null "
             f"(`{plan.null_arm}` against a second server of itself, same rounds) lies within "
             f"{NULL_BAND[0]}-{NULL_BAND[1]}; nulls: each counted slice's, in order. tax: tok/s "
             "with the grammar / without, same servers (DFLASH's beside). accept: accept "
             "length, this arm / DFLASH.", ""]
    combined = combined_cells(plan, results)
    if combined:
        lines += ["| slice | kind | c | arm | x DFLASH | x plain | tax (DFLASH's) | accept "
                  "(DFLASH's) | n | nulls | cards | results |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    else:
        lines.append("No serving cell counts yet.")
    for e in combined:
        tax = f"{_summary(e['tax'])} ({_summary(e['tax_dflash'])})" if e["tax"] else "-"
        accept = (f"{_summary(e['accept'])} ({_summary(e['accept_dflash'])})"
                  if e["accept"] else "-")
        cards = ", ".join(sorted(set(c.replace("NVIDIA ", "") for c in e["cards"])))
        links = " ".join(f"[{i + 1}]({link_prefix}{f}/)" for i, f in enumerate(e["folders"]))
        nulls = ", ".join(f"{x:.3f}" for x in e["nulls"])
        lines.append(f"| {e['slice']} | {e['kind']} | {e['concurrency']} | {e['arm']} | "
                     f"{_summary(e['x_dflash'])} | {_summary(e['x_plain'])} | {tax} | {accept} "
                     f"| {len(e['folders'])} | {nulls} | {cards} | {links} |")
    left_out = [r for r in slice_cells(results) if not r["counts"]]
    if left_out:
        lines += ["", "Measured but not counted (a failed slice, a slice without a null, or a "
                  f"null outside {NULL_BAND[0]}-{NULL_BAND[1]}); each slice's own ratios:", "",
                  "| slice | kind | c | arm | x DFLASH | x plain | null | why | card | result |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in left_out:
            lines.append(f"| {r['slice']} | {r['kind']} | {r['concurrency']} | {r['arm']} | "
                         f"{_num(r['x_dflash'])} | {_num(r['x_plain'])} | "
                         f"{_num(r['null'], '.3f')} | {r['why']} | "
                         f"{r['card'].replace('NVIDIA ', '')} | "
                         f"[{r['folder']}]({link_prefix}{r['folder']}/) |")
    notes = adoption_notes(results)
    phases = [r for r in results if r["meta"].get("phase")]
    if phases:
        lines += ["", "| phase slice | result | commit | card | date | folder |",
                  "|---|---|---|---|---|---|"]
        for r in phases:
            lines.append(f"| {r['meta']['slice']} | "
                         f"{'**failed**' if slice_failures(r) else 'passed'} (exit {r.get('rc')})"
                         f" | {commit_text(r, notes)} | {r['meta']['device']} | "
                         f"{r['meta']['date']} | [{r['folder']}]({link_prefix}{r['folder']}/) |")
    lines += failed_slice_lines(results, notes, link_prefix)
    lines += profile_lines(phases, link_prefix, notes)
    lines += note_lines(results, notes, link_prefix)
    pending = next_slices(plan, have)
    lines += ["", f"Pending ({plan.slices_per_cell} counted results per cell wanted): " + (
        "; ".join(f"{s.id} (item {s.item}) at c = {', '.join(map(str, lv))}" if not s.phase
                  else f"{s.id} (item {s.item}, phase {s.phase})" for s, lv in pending)
        or "none") + "."]
    return "\n".join(lines) + "\n"


def adoption_notes(results: list[dict]) -> dict[str, int]:
    """Each distinct note recorded at adoption (`evidence.py adopt --note`: what the code that
    ran differed in from its commit), numbered in order of first appearance."""
    texts = dict.fromkeys(r["meta"]["note"] for r in results if r["meta"].get("note"))
    return {text: i + 1 for i, text in enumerate(texts)}


def commit_text(result: dict, notes: dict[str, int]) -> str:
    """A slice's commit as the report shows it: with its note's number where one was given,
    so a slice run on changed code is never read as a run of that commit."""
    commit = result["meta"].get("commit", "?")
    note = result["meta"].get("note")
    return f"{commit} (not as committed: note {notes[note]})" if note else commit


def note_lines(results: list[dict], notes: dict[str, int], link_prefix: str = "") -> list[str]:
    """The notes given at adoption, each with the commits and slices it concerns."""
    lines = ["", "Notes given at adoption: these slices did not run their commit as "
             "committed."] if notes else []
    for text, n in notes.items():
        mine = [r for r in results if r["meta"].get("note") == text]
        commits = ", ".join(dict.fromkeys(r["meta"].get("commit", "?") for r in mine))
        links = ", ".join(f"[{r['folder']}]({link_prefix}{r['folder']}/)" for r in mine)
        lines += ["", f"{n}. {commits}: {text} Slices: {links}."]
    return lines


def failed_slice_lines(results: list[dict], notes: dict[str, int],
                       link_prefix: str = "") -> list[str]:
    """Every failed slice (slice_failures), serving or phase: its failed arms, each with its
    first error line.  They count nothing; a serving one whose arms all failed is seen only
    here."""
    failed = [(r, why) for r in results if (why := slice_failures(r))]
    if not failed:
        return []
    lines = ["", "Failed slices (they count nothing; each failed arm with its first error "
             "line):", ""]
    for r, why in failed:
        m = r["meta"]
        lines.append(f"- {m['slice']} ([{r['folder']}]({link_prefix}{r['folder']}/); "
                     f"{commit_text(r, notes)}, {m['device'].replace('NVIDIA ', '')}, "
                     f"{m['date']}): " + "; ".join(f"`{a}`: {line}" for a, line in why.items()))
    return lines


def profile_lines(phases: list[dict], link_prefix: str = "",
                  notes: dict[str, int] | None = None) -> list[str]:
    """The decode-step profiles of the phase slices (bench/profile.py), one row per arm@batch:
    step span, GPU busy and idle inside it, and the host's launches per step."""
    rows = [(r, cell, p) for r in phases for _, out in sorted(r.get("outputs", {}).items())
            if isinstance(out, dict) for cell, p in (out.get("profiles") or {}).items()]
    if not rows:
        return []
    lines = ["", "Decode-step profiles (per step, ms; launches per step from the host's CUDA "
             "runtime calls: eager = kernels launched outside CUDA graphs, graphs = graph "
             "replays):", "",
             "| slice | commit | card | arm@batch | span | GPU busy | GPU idle | eager launches "
             "| graph launches | memcpy / memset | result |", "|---|---|---|---|---|---|---|---|"
             "---|---|---|"]
    for r, cell, p in rows:
        la = p.get("launches") or {}
        launches = (f"{la['eager']} | {la['graph']} | {la['memcpy']} / {la['memset']}"
                    if la.get("recorded") else "- | - | -")
        lines.append(f"| {r['meta']['slice']} | {commit_text(r, notes or {})} | "
                     f"{r['meta']['device'].replace('NVIDIA ', '')} | {cell} | {p['span_ms']} | "
                     f"{p['busy_ms']} | {p['idle_ms']} | {launches} | "
                     f"[{r['folder']}]({link_prefix}{r['folder']}/) |")
    return lines


def plot(plan: EvidencePlan, results: list[dict], path: Path) -> Path | None:
    """DDTREE / DFLASH per cell and arm: the counted slices' median with its range (filled),
    and the measured cells that do not count (grey, hollow)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = [r for r in slice_cells(results) if r["x_dflash"] is not None]
    keys = list(dict.fromkeys((r["slice"], r["kind"], r["concurrency"], r["arm"]) for r in recs))
    if not keys:
        return None
    fig, ax = plt.subplots(figsize=(max(6.0, 0.35 * len(keys)), 4.5))
    for i, key in enumerate(keys):
        mine = [r for r in recs if (r["slice"], r["kind"], r["concurrency"], r["arm"]) == key]
        counted = [r["x_dflash"] for r in mine if r["counts"]]
        if counted:
            med = statistics.median(counted)
            ax.errorbar([i], [med], yerr=[[med - min(counted)], [max(counted) - med]], fmt="o",
                        color="C0", capsize=3)
        other = [r["x_dflash"] for r in mine if not r["counts"]]
        ax.plot([i] * len(other), other, "o", mfc="none", color="grey")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks(range(len(keys)), [f"{s}\n{k} c{c}\n{a}" for s, k, c, a in keys],
                  rotation=90, fontsize=6)
    ax.set_ylabel("speed / DFLASH's (same slice)")
    ax.set_title("Evidence slices: DDTREE / DFLASH\nfilled: counted slices, median [range]; "
                 "hollow: a slice that does not count", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
