"""Every DDTREE setting in one frozen object: the SGLANG_DDTREE_* environment knobs and what
the server arguments fix (the tree budget, the draft block).

`DDTreeSettings.from_values` is the one place a knob is read and checked: argument
validation (server_args.validate) builds it (a bad value stops the server at startup, naming
the accepted values), and the worker builds it once in its own process from the same
arguments and environment (server_args.settings_from_args).
Nothing else reads `os.environ`.  `KNOBS` is the table behind it; `check_env` serves the
benchmark's per-arm environments.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from ddtree_sglang.budget.controller import candidate_budgets


class DDTreeConfigError(ValueError):
    """A server argument or knob DDTREE cannot run with; the message names the accepted values."""


MAX_BUDGET = 1023
BUDGETS_ENV = "SGLANG_DDTREE_BUDGETS"
EXPLORE_ENV = "SGLANG_DDTREE_EXPLORE_EVERY"
MIN_GAIN_ENV = "SGLANG_DDTREE_BUDGET_MIN_GAIN"
VERIFY_ATTENTION_ENV = "SGLANG_DDTREE_VERIFY_ATTENTION"
HOST_TIMING_ENV = "SGLANG_DDTREE_HOST_TIMING"
BUDGET_TRACE_ENV = "SGLANG_DDTREE_BUDGET_TRACE"
TREE_KERNEL_ENV = "SGLANG_DDTREE_TREE_KERNEL"
CUDA_GRAPH_TREE_ENV = "SGLANG_DDTREE_CUDA_GRAPH_TREE"
GRAMMAR_ENV = "SGLANG_DDTREE_GRAMMAR"
GRAMMAR_METHODS = ("tree", "path", "auto", "python")  # sglang_plugin/grammar_stage.py
GRAMMAR_BUDGET_ENV = "SGLANG_DDTREE_GRAMMAR_BUDGET"
GRAMMAR_TREE_ENV = "SGLANG_DDTREE_GRAMMAR_TREE"
GRAMMAR_FORCE_ENV = "SGLANG_DDTREE_GRAMMAR_FORCE"
UNCHECKED_ENV = "SGLANG_DDTREE_UNCHECKED"
UNCHECKED_SETUPS = ("tp", "page_size")  # implemented, refused until a GPU run checks them
MAX_CHECKED_PAGE_SIZE = 64
DEFAULT_EXPLORE_EVERY = 32
DEFAULT_MIN_GAIN = 0.03


def parse_budgets(value: str, max_budget: int) -> tuple[int, ...]:
    """SGLANG_DDTREE_BUDGETS -> the ascending candidate budgets, ending with `max_budget`:
    "auto" = budget.candidate_budgets(B), "off" = always B, or a comma list (B is added)."""
    value = value.strip()
    if value == "auto":
        return tuple(candidate_budgets(max_budget))
    if value == "off":
        return (max_budget,)
    accepted = (f"accepted: auto (default), off (always B = {max_budget}), or a comma list of "
                f"budgets in 1..{max_budget} (B = --speculative-num-draft-tokens - 1 is always "
                "one of them)")
    try:
        budgets = sorted({int(x) for x in value.split(",")})
    except ValueError:
        raise DDTreeConfigError(f"{BUDGETS_ENV}={value!r} is not accepted; {accepted}") from None
    if budgets[0] < 1 or budgets[-1] > max_budget:
        raise DDTreeConfigError(f"{BUDGETS_ENV}={value!r} names a budget outside 1..{max_budget};"
                                f" {accepted}")
    return tuple(budgets if budgets[-1] == max_budget else budgets + [max_budget])


def _choice(name: str, values: tuple[str, ...]) -> Callable[[str], str]:
    def parse(value: str) -> str:
        if value not in values:
            raise DDTreeConfigError(f"{name}={value!r} is not accepted; accepted: "
                                    f"{', '.join(values)} (default {values[0]})")
        return value
    return parse


def parse_unchecked(value: str) -> tuple[str, ...]:
    """SGLANG_DDTREE_UNCHECKED: off, or a comma list of the set-ups to start before their GPU
    check (for that check)."""
    value = value.strip()
    if value == "off":
        return ()
    names = tuple(x.strip() for x in value.split(",") if x.strip())
    bad = [x for x in names if x not in UNCHECKED_SETUPS]
    if bad or not names:
        raise DDTreeConfigError(f"{UNCHECKED_ENV}={value!r} is not accepted; accepted: off "
                                f"(default) or a comma list of {', '.join(UNCHECKED_SETUPS)}")
    return names


def unchecked_setups(environ: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """The set-ups awaiting their GPU check that this environment starts anyway."""
    env = os.environ if environ is None else environ
    return parse_unchecked(env.get(UNCHECKED_ENV, "off"))


def _explore_every(value: str) -> int:
    try:
        n = int(value.strip())
    except ValueError:
        n = -1
    if n != 0 and n < 2:
        raise DDTreeConfigError(f"{EXPLORE_ENV}={value!r} is not accepted; accepted: an integer "
                                f">= 2 (one step in N per batch size tries the least-measured "
                                f"budget; default {DEFAULT_EXPLORE_EVERY}) or 0 (never)")
    return n


def _min_gain(value: str) -> float:
    try:
        x = float(value.strip())
    except ValueError:
        x = -1.0
    if not 0.0 <= x <= 0.5:
        raise DDTreeConfigError(f"{MIN_GAIN_ENV}={value!r} is not accepted; accepted: a number "
                                f"in [0, 0.5], the least predicted gain in tokens/ms the "
                                f"batch-aware budget acts on (default {DEFAULT_MIN_GAIN}: "
                                f"{DEFAULT_MIN_GAIN:.0%}; 0: any gain)")
    return x


@dataclass(frozen=True)
class Knob:
    """One SGLANG_DDTREE_* environment setting: its default and its parser (raising
    DDTreeConfigError that names the accepted values)."""

    name: str
    default: str
    parse: Callable[[str], Any]
    meaning: str


_KNOB_LIST = (
    Knob(BUDGETS_ENV, "auto", lambda v: parse_budgets(v, MAX_BUDGET),
         "the batch-aware budget's candidates: auto, off, or a comma list"),
    Knob(MIN_GAIN_ENV, str(DEFAULT_MIN_GAIN), _min_gain,
         "the least predicted gain the batch-aware budget acts on"),
    Knob(EXPLORE_ENV, str(DEFAULT_EXPLORE_EVERY), _explore_every,
         "one step in N per batch size verifies the least-measured candidate (0: never)"),
    Knob(TREE_KERNEL_ENV, "auto", _choice(TREE_KERNEL_ENV, ("auto", "torch", "triton")),
         "the tree builder: the fused Triton kernel where it fits (auto), or PyTorch"),
    Knob(VERIFY_ATTENTION_ENV, "kernel",
         _choice(VERIFY_ATTENTION_ENV, ("kernel", "single", "split")),
         "the tree verify attention with the triton backend"),
    Knob(CUDA_GRAPH_TREE_ENV, "1", _choice(CUDA_GRAPH_TREE_ENV, ("1", "0")),
         "CUDA graphs for the tree and acceptance stages"),
    Knob(GRAMMAR_ENV, "tree", _choice(GRAMMAR_ENV, GRAMMAR_METHODS),
         "structured output's masks: native per node (tree), along the accepted path "
         "(path: greedy requests by the target's top-K, others with a mask per visited node), "
         "path where a request's tree masks cost more than its walk (auto), or SGLang's "
         "Python traversal (python)"),
    Knob(GRAMMAR_BUDGET_ENV, "shared", _choice(GRAMMAR_BUDGET_ENV, ("shared", "own")),
         "the batch-aware budget for batches with a grammar: the same costs as the rest "
         "(shared), or step costs and statistics of their own (own: their tree sized by what "
         "their steps, grammar masks included, take on this host)"),
    Knob(GRAMMAR_TREE_ENV, "all", _choice(GRAMMAR_TREE_ENV, ("all", "valid")),
         "which candidate nodes a constrained request verifies: the tree's best (all), or its "
         "best grammar-valid ones (valid: the tree is read back and checked on the host "
         "before the verify; room to gain where the verify is narrower than the candidate "
         "tree)"),
    Knob(GRAMMAR_FORCE_ENV, "off", _choice(GRAMMAR_FORCE_ENV, ("off", "spine")),
         "tokens the grammar forces at a constrained request's root (spine: its jump-forward "
         "string, tokenized by the request's tokenizer, takes the tree's first depths; "
         "CPU-tested, opt-in until a GPU slice measures it)"),
    Knob(UNCHECKED_ENV, "off", parse_unchecked,
         "set-ups implemented but refused until a GPU run checks them, started anyway: tp "
         "(--tp-size > 1), page_size (--page-size 2..64); for those GPU checks"),
    Knob(HOST_TIMING_ENV, "0", _choice(HOST_TIMING_ENV, ("0", "1")),
         "log the host's time per decode step by stage"),
    Knob(BUDGET_TRACE_ENV, "1", _choice(BUDGET_TRACE_ENV, ("1", "0")),
         "the per-step budget list in each response's meta_info"),
)
KNOBS: dict[str, Knob] = {k.name: k for k in _KNOB_LIST}


PREFIX = "SGLANG_DDTREE_"


def unknown_name_error(name: str) -> str:
    """The message for a SGLANG_DDTREE_* name that is no knob: the nearest known one first."""
    import difflib

    tails = {k.removeprefix(PREFIX): k for k in KNOBS}  # the shared prefix says nothing
    near = difflib.get_close_matches(name.removeprefix(PREFIX), tails, n=1, cutoff=0.6)
    hint = f"did you mean {tails[near[0]]}? " if near else ""
    return f"unknown setting {name!r}; {hint}accepted: {', '.join(sorted(KNOBS))}"


def check_env(name: str, value: str) -> None:
    """Raise DDTreeConfigError naming the accepted names / values if `name=value` is not a
    DDTREE knob setting (a benchmark arm's env: the budget list is checked against 1..1023,
    the server checks it against its B)."""
    knob = KNOBS.get(name)
    if knob is None:
        raise DDTreeConfigError(unknown_name_error(name))
    knob.parse(value)


@dataclass(frozen=True)
class DDTreeSettings:
    """What one DDTREE server runs with (see KNOBS for the knobs' meanings)."""

    budget: int  # B: the largest tree, --speculative-num-draft-tokens - 1
    block_size: int  # the draft block (the drafter's, or --speculative-dflash-block-size)
    budgets: tuple[int, ...]  # the batch-aware candidates, ending with B
    min_gain: float
    explore_every: int
    tree_kernel: str
    verify_attention: str
    verify_attention_named: bool  # named in the environment (not the default)
    cuda_graph_tree: bool
    grammar: str
    grammar_budget: str
    grammar_tree: str
    grammar_force: str
    host_timing: bool
    budget_trace: bool

    @property
    def depth(self) -> int:
        """The tree's depth: the draft block minus its root."""
        return self.block_size - 1

    @property
    def verify_width(self) -> int:
        """Tokens a request verifies at the largest budget: the root and B nodes."""
        return self.budget + 1

    @classmethod
    def from_values(cls, budget: int, block_size: int,
                    environ: Mapping[str, str] | None = None) -> "DDTreeSettings":
        """The settings for a budget and block, with the knobs of `environ` (default: this
        process's environment); raises DDTreeConfigError listing every bad knob and every
        SGLANG_DDTREE_* name that is none (a misspelt knob would otherwise be ignored)."""
        env = os.environ if environ is None else environ
        errors: list[str] = [unknown_name_error(name) for name in sorted(env)
                             if name.startswith(PREFIX) and name not in KNOBS]
        values: dict[str, Any] = {}
        for knob in _KNOB_LIST:
            raw = env.get(knob.name, knob.default)
            try:
                values[knob.name] = (parse_budgets(raw, budget) if knob.name == BUDGETS_ENV
                                     else knob.parse(raw))
            except DDTreeConfigError as exc:
                errors.append(str(exc))
        if errors:
            raise DDTreeConfigError("\n  - ".join(errors))
        return cls(budget=budget, block_size=block_size, budgets=values[BUDGETS_ENV],
                   min_gain=values[MIN_GAIN_ENV], explore_every=values[EXPLORE_ENV],
                   tree_kernel=values[TREE_KERNEL_ENV],
                   verify_attention=values[VERIFY_ATTENTION_ENV],
                   verify_attention_named=VERIFY_ATTENTION_ENV in env,
                   cuda_graph_tree=values[CUDA_GRAPH_TREE_ENV] == "1",
                   grammar=values[GRAMMAR_ENV], grammar_budget=values[GRAMMAR_BUDGET_ENV],
                   grammar_tree=values[GRAMMAR_TREE_ENV],
                   grammar_force=values[GRAMMAR_FORCE_ENV],
                   host_timing=values[HOST_TIMING_ENV] == "1",
                   budget_trace=values[BUDGET_TRACE_ENV] == "1")
