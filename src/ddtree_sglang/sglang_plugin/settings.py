"""Every DDTREE setting in one frozen object: the SGLANG_DDTREE_* environment settings and
what the server arguments fix (the tree budget, the draft block).

A user sets the budget (--speculative-num-draft-tokens, and SGLANG_DDTREE_BUDGETS for the
batch-aware choice) and, for structured output, the grammar method and its forced spine.
Everything else is fixed by measurement; what a maintainer may still switch for a diagnosis or
a GPU check sits under one setting, SGLANG_DDTREE_DEBUG (DEBUG_FLAGS says what each flag does).

`DDTreeSettings.from_values` is the one place the server reads them: argument validation
(server_args.validate) builds it (a bad value stops the server at startup, naming the accepted
values), the worker builds it once in its own process from the same arguments and environment
(server_args.settings_from_args), and `ddtree-check` reports the same problems before a GPU is
needed (`environment_problems`).  `check_env` serves the benchmark's per-arm environments.
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from ddtree_sglang.budget.controller import candidate_budgets


class DDTreeConfigError(ValueError):
    """A server argument or setting DDTREE cannot run with; the message names the accepted
    values."""


MAX_BUDGET = 1023
PREFIX = "SGLANG_DDTREE_"
BUDGETS_ENV = "SGLANG_DDTREE_BUDGETS"
GRAMMAR_ENV = "SGLANG_DDTREE_GRAMMAR"
GRAMMAR_METHODS = ("tree", "path", "auto")  # sglang_plugin/grammar_stage.py
GRAMMAR_FORCE_ENV = "SGLANG_DDTREE_GRAMMAR_FORCE"
DEBUG_ENV = "SGLANG_DDTREE_DEBUG"
SIMULATE_ENV = "SGLANG_DDTREE_SIMULATE_ACC"
# The least predicted gain the batch-aware budget acts on, and how often it explores a
# candidate it has measured least (budget/controller.py says why; fixed by measurement).
MIN_GAIN = 0.03
EXPLORE_EVERY = 32
# Page sizes checked on a GPU against plain SGLang at the same page size; 2..64 are implemented
# (CPU-tested) and start only under SGLANG_DDTREE_DEBUG=unchecked.
CHECKED_PAGE_SIZES = (1, 16)
MAX_UNCHECKED_PAGE_SIZE = 64

DEBUG_FLAGS = {
    "host_timing": "log the host's milliseconds per decode step, by stage",
    "torch_tree": "build the tree with PyTorch instead of the fused Triton kernel",
    "sglang_attention": "verify with SGLang's own masked extend kernel instead of DDTREE's "
                        "tree-attention kernel",
    "unchecked": "start set-ups implemented but not yet checked on a GPU against plain "
                 "SGLang (--tp-size > 1, --page-size 2..64 other than 16, gated-delta hybrid "
                 "targets such as Qwen3-Next and Qwen3.5), for that check",
    "switch_budgets": "the batch-aware budget explores every second step and acts on any "
                      "predicted gain, so that requests move between budgets (for the GPU "
                      "check that they stay exact)",
}


def parse_budgets(value: str, max_budget: int) -> tuple[int, ...]:
    """SGLANG_DDTREE_BUDGETS -> the ascending candidate budgets, ending with `max_budget`:
    "auto" = budget.candidate_budgets(B), "off" = always B, or a comma list (B is added; 0 is
    no speculation: a step that drafts nothing and decodes one token, chosen where the
    measured tokens per ms say speculation does not pay)."""
    value = value.strip()
    if value == "auto":
        return tuple(candidate_budgets(max_budget))
    if value == "off":
        return (max_budget,)
    accepted = (f"accepted: auto (default), off, or a comma list of budgets in 0..{max_budget} "
                "(0: no speculation); auto chooses per decode batch among budgets up to B, off "
                "always verifies B, a list chooses among its budgets and B, where B is the "
                "server's tree budget, --speculative-num-draft-tokens - 1")
    try:
        budgets = sorted({int(x) for x in value.split(",")})
    except ValueError:
        raise DDTreeConfigError(f"{BUDGETS_ENV}={value!r} is not accepted; {accepted}") from None
    if budgets[0] < 0 or budgets[-1] > max_budget:
        raise DDTreeConfigError(f"{BUDGETS_ENV}={value!r} names a budget outside 0..{max_budget};"
                                f" {accepted}")
    return tuple(budgets if budgets[-1] == max_budget else budgets + [max_budget])


def parse_curve(value: str) -> tuple[tuple[int, float], ...]:
    """SGLANG_DDTREE_SIMULATE_ACC: empty (off, the default), or a comma list of budget:tau
    points, a benchmark's forced mean commit length per budget (the tau of a published budget
    plot), for serving random weights as SGLang's SGLANG_SIMULATE_ACC_LEN serves DFLASH."""
    value = value.strip()
    if not value:
        return ()
    accepted = (f"accepted: empty (off, the default) or a comma list of budget:tau points, "
                f"budgets in 1..{MAX_BUDGET}, each tau in 1..budget + 1 (e.g. 16:8.6,32:9.3)")
    try:
        points = {int(b): float(t) for b, t in (x.split(":") for x in value.split(","))}
    except ValueError:
        raise DDTreeConfigError(f"{SIMULATE_ENV}={value!r} is not accepted; {accepted}") from None
    if any(not 1 <= b <= MAX_BUDGET or not 1.0 <= t <= b + 1 for b, t in points.items()):
        raise DDTreeConfigError(f"{SIMULATE_ENV}={value!r} has a point out of range; {accepted}")
    return tuple(sorted(points.items()))


def _choice(name: str, values: tuple[str, ...]) -> Callable[[str], str]:
    def parse(value: str) -> str:
        if value not in values:
            raise DDTreeConfigError(f"{name}={value!r} is not accepted; accepted: "
                                    f"{', '.join(values)} (default {values[0]})")
        return value
    return parse


def parse_debug(value: str) -> frozenset[str]:
    """SGLANG_DDTREE_DEBUG: empty (the default), or a comma list of DEBUG_FLAGS."""
    names = frozenset(x.strip() for x in value.split(",") if x.strip())
    bad = sorted(names - set(DEBUG_FLAGS))
    if bad:
        raise DDTreeConfigError(f"{DEBUG_ENV}={value!r} names unknown flag(s) {', '.join(bad)}; "
                                f"accepted: a comma list of {', '.join(DEBUG_FLAGS)} "
                                "(default: none)")
    return names


@dataclass(frozen=True)
class Setting:
    """One SGLANG_DDTREE_* environment setting: its default and its parser (raising
    DDTreeConfigError that names the accepted values)."""

    name: str
    default: str
    parse: Callable[[str], Any]


_SETTING_LIST = (
    Setting(BUDGETS_ENV, "auto", lambda v: parse_budgets(v, MAX_BUDGET)),
    Setting(GRAMMAR_ENV, "tree", _choice(GRAMMAR_ENV, GRAMMAR_METHODS)),
    Setting(GRAMMAR_FORCE_ENV, "off", _choice(GRAMMAR_FORCE_ENV, ("off", "spine"))),
    Setting(DEBUG_ENV, "", parse_debug),
    Setting(SIMULATE_ENV, "", parse_curve),
)
SETTINGS: dict[str, Setting] = {k.name: k for k in _SETTING_LIST}


def unknown_name_error(name: str) -> str:
    """The message for a SGLANG_DDTREE_* name that is no setting: the nearest known one first,
    and where a setting of an earlier release went."""
    tails = {k.removeprefix(PREFIX): k for k in SETTINGS}  # the shared prefix says nothing
    near = difflib.get_close_matches(name.removeprefix(PREFIX), tails, n=1, cutoff=0.6)
    hint = f"did you mean {tails[near[0]]}? " if near else ""
    gone = RETIRED.get(name)
    if gone:
        hint = f"it was retired: {gone}; "
    return f"unknown setting {name!r}; {hint}accepted: {', '.join(sorted(SETTINGS))}"


# Settings of earlier releases, and what replaced them (a user upgrading reads why).
RETIRED = {
    f"{PREFIX}BUDGET_MIN_GAIN": f"fixed at {MIN_GAIN}",
    f"{PREFIX}EXPLORE_EVERY": f"fixed at {EXPLORE_EVERY}",
    f"{PREFIX}BUDGET_TRACE": "each response's meta_info.ddtree_budget is always reported",
    f"{PREFIX}TREE_KERNEL": f"{DEBUG_ENV}=torch_tree",
    f"{PREFIX}VERIFY_ATTENTION": f"{DEBUG_ENV}=sglang_attention (split lost at every size)",
    f"{PREFIX}CUDA_GRAPH_TREE": "follows SGLang's own CUDA-graph switches",
    f"{PREFIX}HOST_TIMING": f"{DEBUG_ENV}=host_timing",
    f"{PREFIX}UNCHECKED": f"{DEBUG_ENV}=unchecked (page size 16 needs nothing)",
    f"{PREFIX}GRAMMAR_TREE": "the grammar-valid tree was measured on the CPU only and removed",
    f"{PREFIX}GRAMMAR_BUDGET": "the grammar's own budget lane was measured on the CPU only and "
                               "removed",
}


def check_env(name: str, value: str) -> None:
    """Raise DDTreeConfigError naming the accepted names / values if `name=value` is not a
    DDTREE setting (a benchmark arm's env: the budget list is checked against 1..1023, the
    server checks it against its B)."""
    setting = SETTINGS.get(name)
    if setting is None:
        raise DDTreeConfigError(unknown_name_error(name))
    setting.parse(value)


def environment_problems(environ: Mapping[str, str] | None = None,
                         max_budget: int = MAX_BUDGET) -> list[str]:
    """Every problem with the SGLANG_DDTREE_* settings of `environ` (default: this process's):
    unknown names and bad values, one message each (empty: all good)."""
    env = os.environ if environ is None else environ
    problems = [unknown_name_error(name) for name in sorted(env)
                if name.startswith(PREFIX) and name not in SETTINGS]
    for setting in _SETTING_LIST:
        raw = env.get(setting.name, setting.default)
        try:
            parse_budgets(raw, max_budget) if setting.name == BUDGETS_ENV else setting.parse(raw)
        except DDTreeConfigError as exc:
            problems.append(str(exc))
    return problems


def debug_flags(environ: Mapping[str, str] | None = None) -> frozenset[str]:
    """The SGLANG_DDTREE_DEBUG flags of `environ` (default: this process's)."""
    env = os.environ if environ is None else environ
    return parse_debug(env.get(DEBUG_ENV, ""))


@dataclass(frozen=True)
class DDTreeSettings:
    """What one DDTREE server runs with."""

    budget: int  # B: the largest tree, --speculative-num-draft-tokens - 1
    block_size: int  # the draft block (the drafter's, or --speculative-dflash-block-size)
    budgets: tuple[int, ...] = ()  # the batch-aware candidates, ending with B (() = (B,))
    grammar_method: str = "tree"  # SGLANG_DDTREE_GRAMMAR
    grammar_force: str = "off"  # SGLANG_DDTREE_GRAMMAR_FORCE
    debug: frozenset[str] = frozenset()  # SGLANG_DDTREE_DEBUG
    simulate_acc: tuple[tuple[int, float], ...] = ()  # SGLANG_DDTREE_SIMULATE_ACC (benchmarks)
    min_gain: float = MIN_GAIN
    explore_every: int = EXPLORE_EVERY

    def __post_init__(self) -> None:
        if not self.budgets:
            object.__setattr__(self, "budgets", (self.budget,))

    @property
    def depth(self) -> int:
        """The tree's depth: the draft block minus its root."""
        return self.block_size - 1

    @property
    def verify_width(self) -> int:
        """Tokens a request verifies at the largest budget: the root and B nodes."""
        return self.budget + 1

    @property
    def host_timing(self) -> bool:
        return "host_timing" in self.debug

    @property
    def tree_kernel(self) -> str:
        """The tree builder asked for: the fused Triton kernel where it fits, or PyTorch."""
        return "torch" if "torch_tree" in self.debug else "auto"

    @property
    def verify_attention(self) -> str:
        """The tree verify attention asked for with the triton backend: DDTREE's kernel
        (checked against SGLang's at startup) or SGLang's own ("single")."""
        return "single" if "sglang_attention" in self.debug else "kernel"

    @classmethod
    def from_values(cls, budget: int, block_size: int,
                    environ: Mapping[str, str] | None = None) -> "DDTreeSettings":
        """The settings for a budget and block, with the SGLANG_DDTREE_* settings of `environ`
        (default: this process's environment); raises DDTreeConfigError listing every bad
        value and every SGLANG_DDTREE_* name that is none (a misspelt setting would otherwise
        be ignored)."""
        env = os.environ if environ is None else environ
        problems = environment_problems(env, budget)
        if problems:
            raise DDTreeConfigError("\n  - ".join(problems))

        def value(name: str) -> str:
            return env.get(name, SETTINGS[name].default)

        debug = parse_debug(value(DEBUG_ENV))
        switch = "switch_budgets" in debug
        budgets = parse_budgets(value(BUDGETS_ENV), budget)
        curve = parse_curve(value(SIMULATE_ENV))
        outside = [b for b in budgets if b and curve and not curve[0][0] <= b <= curve[-1][0]]
        if outside:
            raise DDTreeConfigError(
                f"{SIMULATE_ENV} covers budgets {curve[0][0]}..{curve[-1][0]}, not the server's "
                f"candidate(s) {outside} (of {list(budgets)}); accepted: a curve whose first and "
                "last budgets enclose every candidate (an extrapolated acceptance is a guess)")
        return cls(budget=budget, block_size=block_size, budgets=budgets, simulate_acc=curve,
                   grammar_method=value(GRAMMAR_ENV), grammar_force=value(GRAMMAR_FORCE_ENV),
                   debug=debug, min_gain=0.0 if switch else MIN_GAIN,
                   explore_every=2 if switch else EXPLORE_EVERY)
