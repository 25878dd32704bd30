"""The evidence plan: GPU results collected in slices that add up across device calls, sessions
and cards (configs/evidence.yaml, `bash scripts/gpu_run.sh evidence`).

A *slice* is one plan entry measured in one device call: every arm of its cells on one machine,
interleaved, so its ratios (DDTREE / DFLASH, / plain, the grammar tax) are paired.  Its result
lands in `<results>/<slice id>/<date>_<card>_<n>/slice.json`.  Each cell (slice id, grammar
kind, concurrency) wants `slices_per_cell` committed results; the runner takes the plan's slices
in order, runs the levels whose cells still lack results, and stops starting cells before its
time limit, so a later call (on any card) continues where this one stopped.  Slices combine only
through their ratios: absolute tok/s never leave their slice.

Slices of kind `phase` run a GPU check or profile of scripts/gpu_run.sh (e2e, features, cost,
profile) as one cell; their result is the phase's files and exit code.
"""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path
from typing import Literal, Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ddtree_bench.config import Arm, BenchConfig, ConfigError, describe_errors
from ddtree_bench.grammars import kind_names

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
    seconds: Optional[float] = Field(None, gt=0, description="sustained load per measurement")
    rounds: Optional[int] = Field(None, ge=1)
    phase: Optional[Literal[PHASES]] = None
    env: dict[str, str] = Field({}, description="environment of a phase (its knobs)")
    phase_seconds: float = Field(300, gt=0, description="a phase's expected run time")

    @model_validator(mode="after")
    def _shape(self) -> "SlicePlan":
        if self.phase is None and not self.arms:
            raise ValueError(f"slice {self.id}: serving slices need arms (or give a phase)")
        if self.phase is not None and self.arms:
            raise ValueError(f"slice {self.id}: a phase slice takes no arms")
        kind_names(",".join(self.kinds))  # ValueError naming the accepted kinds
        if min(self.concurrency, default=0) < 1:
            raise ValueError(f"slice {self.id}: concurrency levels must be >= 1")
        return self


class EvidencePlan(_Strict):
    slices_per_cell: int = Field(2, ge=1, description="committed results each cell wants")
    call_seconds: float = Field(540, gt=60, description="one device call, startup included")
    startup_seconds: float = Field(200, ge=0, description="a slice's servers, cold machine")
    seconds: float = Field(4, gt=0, description="default sustained load per measurement")
    rounds: int = Field(2, ge=1, description="default interleaved rounds per cell")
    max_new_tokens: int = Field(128, ge=2)
    mem_fraction_static: float = Field(0.25, gt=0, lt=1)
    launcher_module: str = Field("sglang.launch_server", description="module run with -m to "
                                 "start a server (tests use a stand-in)")
    arms: dict[str, Arm] = Field(description="the arms slices name, by name")
    slices: list[SlicePlan]

    @model_validator(mode="after")
    def _names(self) -> "EvidencePlan":
        ids = [s.id for s in self.slices]
        if len(set(ids)) != len(ids):
            raise ValueError(f"slice ids must be unique; got {ids}")
        for s in self.slices:
            unknown = [a for a in s.arms if a not in self.arms]
            if unknown:
                raise ValueError(f"slice {s.id}: unknown arm(s) {', '.join(unknown)}; "
                                 f"accepted: {', '.join(self.arms)}")
            if s.arms and "plain" not in s.arms:
                raise ValueError(f"slice {s.id}: needs the arm 'plain' (the greedy reference)")
        for name, arm in self.arms.items():
            if arm.name != name:
                raise ValueError(f"arm {name!r}: its name field says {arm.name!r}")
        return self


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


def slice_config(plan: EvidencePlan, s: SlicePlan, root: Path,
                 levels: list[int] | None = None) -> BenchConfig:
    """The serving config of a slice (testbed pair, all arms started together, interleaved)."""
    return BenchConfig(
        name=f"evidence-{s.id}", arms=[plan.arms[a] for a in s.arms],
        concurrency=levels or s.concurrency, endpoint="native",
        mem_fraction_static=plan.mem_fraction_static, cuda_graph_max_bs=max(64, *s.concurrency),
        max_total_tokens=262144, startup_group=len(s.arms),
        prompts=dict(source=str(root / "testbed" / "prompts.jsonl"), limit=32),
        model_path=str(root / "testbed" / "target"),
        draft_model_path=str(root / "testbed" / "drafter"), max_new_tokens=plan.max_new_tokens,
        temperature=0.0, min_cell_seconds=s.seconds or plan.seconds,
        launcher_module=plan.launcher_module, startup_timeout_s=600,
        repeats=s.rounds or plan.rounds, warmup_per_cell=True, interleave=True)


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


def counts(results: list[dict]) -> dict[tuple[str, str, int], int]:
    """Committed results per cell: (slice id, kind, concurrency) -> count."""
    n: dict[tuple[str, str, int], int] = {}
    for r in results:
        for kind, conc in cells_of(r):
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


def next_slices(plan: EvidencePlan, have: dict) -> list[tuple[SlicePlan, list[int]]]:
    """The slices still wanted, in plan order, each with the levels to run."""
    return [(s, lv) for s in plan.slices if (lv := pending_levels(plan, s, have))]


def estimate_seconds(plan: EvidencePlan, s: SlicePlan, levels: list[int]) -> float:
    """A slice's expected wall time on a cold machine: startup plus every cell."""
    if s.phase:
        return s.phase_seconds
    from ddtree_bench.slices import WARMUP_S

    per_cell = len(s.arms) * (s.rounds or plan.rounds) * ((s.seconds or plan.seconds) + WARMUP_S)
    return plan.startup_seconds + per_cell * len(levels) * len(s.kinds)


def stamp(date: str, device: str, taken: list[str]) -> str:
    """A result folder's name: date, card (letters and digits) and a serial, unique in `taken`."""
    card = re.sub(r"[^a-z0-9]+", "", device.lower().replace("nvidia", "")) or "cpu"
    n = 1
    while f"{date}_{card}_{n}" in taken:
        n += 1
    return f"{date}_{card}_{n}"


# -- the combined report -----------------------------------------------------------------------

def combined_cells(plan: EvidencePlan, results: list[dict]) -> list[dict]:
    """Per (slice, kind, concurrency, arm): the ratios measured inside each slice, combined:
    median of the slices' median round-ratios with their range, the slice count, the accept
    lengths and the cards.  Ratios are to DFLASH ('dflash') and to plain, and the grammar tax
    (with grammar / without, same servers) beside DFLASH's."""
    from ddtree_bench.slices import grammar_tax, ratio_to

    acc: dict[tuple, dict] = {}
    for res in results:
        if res["meta"].get("phase"):
            continue
        sid, rows = res["meta"]["slice"], res["rows"]
        for kind, conc in sorted(cells_of(res)):
            cell = [r for r in rows if (r["kind"], r["concurrency"]) == (kind, conc)]
            for r in cell:
                if r["arm"] == "plain":
                    continue
                e = acc.setdefault((sid, kind, conc, r["arm"]), dict(
                    slice=sid, kind=kind, concurrency=conc, arm=r["arm"], x_dflash=[],
                    x_plain=[], tax=[], tax_dflash=[], accept=[], accept_dflash=[], cards=[],
                    folders=[]))
                for key, base in (("x_dflash", "dflash"), ("x_plain", "plain")):
                    q = ratio_to(cell, r["arm"], base)
                    if q and r["arm"] != base:
                        e[key].append(q["median"])
                if kind != "none":
                    t, td = grammar_tax(rows, r["arm"], kind, conc), grammar_tax(
                        rows, "dflash", kind, conc)
                    if t and td:
                        e["tax"].append(round(t, 3))
                        e["tax_dflash"].append(round(td, 3))
                d = next((x for x in cell if x["arm"] == "dflash"), None)
                if r.get("accept_length"):
                    e["accept"].append(r["accept_length"])
                if d and d.get("accept_length"):
                    e["accept_dflash"].append(d["accept_length"])
                e["cards"].append(res["meta"]["device"])
                e["folders"].append(res["folder"])
    return list(acc.values())


def _summary(xs: list[float]) -> str:
    if not xs:
        return "-"
    med = statistics.median(xs)
    return f"{med:.2f}" if len(xs) == 1 else f"{med:.2f} [{min(xs):.2f}-{max(xs):.2f}]"


def report_markdown(plan: EvidencePlan, results: list[dict], link_prefix: str = "") -> str:
    """The report over all committed slices: per cell the median ratio, its range over slices,
    the slice count, accept lengths and cards; the phases' results; what is still pending."""
    have = counts(results)
    lines = ["# Evidence: every committed slice, combined", "",
             "Generated by `python benchmarks/evidence.py report` from the slices below "
             "(configs/evidence.yaml). A ratio is measured inside one slice (paired interleaved "
             "rounds, median of rounds); across slices the table gives the median of the slices' "
             "ratios [min-max] and n slices. tax: tok/s with the grammar / without, same servers "
             "(DFLASH's beside). accept: accept length, this arm / DFLASH.", "",
             "| slice | kind | c | arm | x DFLASH | x plain | tax (DFLASH's) | accept (DFLASH's) "
             "| n | cards | results |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for e in combined_cells(plan, results):
        tax = f"{_summary(e['tax'])} ({_summary(e['tax_dflash'])})" if e["tax"] else "-"
        accept = (f"{_summary(e['accept'])} ({_summary(e['accept_dflash'])})"
                  if e["accept"] else "-")
        cards = ", ".join(sorted(set(c.replace("NVIDIA ", "") for c in e["cards"])))
        links = " ".join(f"[{i + 1}]({link_prefix}{f}/)" for i, f in enumerate(e["folders"]))
        lines.append(f"| {e['slice']} | {e['kind']} | {e['concurrency']} | {e['arm']} | "
                     f"{_summary(e['x_dflash'])} | {_summary(e['x_plain'])} | {tax} | {accept} "
                     f"| {len(e['folders'])} | {cards} | {links} |")
    phases = [r for r in results if r["meta"].get("phase")]
    if phases:
        lines += ["", "| phase slice | result | card | date | folder |", "|---|---|---|---|---|"]
        for r in phases:
            lines.append(f"| {r['meta']['slice']} | {'passed' if r.get('rc') == 0 else 'failed'}"
                         f" (exit {r.get('rc')}) | {r['meta']['device']} | {r['meta']['date']} "
                         f"| [{r['folder']}]({link_prefix}{r['folder']}/) |")
    pending = next_slices(plan, have)
    lines += ["", f"Pending ({plan.slices_per_cell} results per cell wanted): " + (
        "; ".join(f"{s.id} (item {s.item}) at c = {', '.join(map(str, lv))}" if not s.phase
                  else f"{s.id} (item {s.item}, phase {s.phase})" for s, lv in pending)
        or "none") + "."]
    return "\n".join(lines) + "\n"


def plot(plan: EvidencePlan, results: list[dict], path: Path) -> Path | None:
    """DDTREE / DFLASH per cell and arm, median over slices with its range."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [e for e in combined_cells(plan, results) if e["x_dflash"] and e["arm"] != "dflash"]
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(max(6.0, 0.35 * len(rows)), 4.5))
    labels = [f"{e['slice']}\n{e['kind']} c{e['concurrency']}\n{e['arm']}" for e in rows]
    med = [statistics.median(e["x_dflash"]) for e in rows]
    lo = [m - min(e["x_dflash"]) for m, e in zip(med, rows)]
    hi = [max(e["x_dflash"]) - m for m, e in zip(med, rows)]
    ax.errorbar(range(len(rows)), med, yerr=[lo, hi], fmt="o", capsize=3)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks(range(len(rows)), labels, rotation=90, fontsize=6)
    ax.set_ylabel("tok/s / DFLASH's (same slice)")
    ax.set_title("Evidence slices: DDTREE / DFLASH, median over slices [range]")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
