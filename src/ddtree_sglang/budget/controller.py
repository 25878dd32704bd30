"""Choosing the tree budget per decode batch: the most committed tokens per millisecond.

DDTree's own objective gives the value side for free.  The tree of the b best prefixes (the
builder's output, best-first) accepts on average

    E[accepted draft tokens | b] = sum of the b best prefix probabilities

when the target agrees with the drafter's marginals (each prefix is accepted exactly when all of
its tokens are), and every step commits one more token (the bonus).  Real targets disagree with
the drafter in a depth-dependent way, so `DepthCalibration` keeps, per depth, an EMA of observed
over predicted acceptance and scales the prediction with it.  The cost side is a table of step
times per (batch size, budget), measured by the engine.  `choose_budget` then maximises

    batch committed tokens / step time

over the budgets that have a cost.  The value side (`expected_by_depth_per_request`, `DepthCalibration`) is
batched tensor code without host synchronisation, so an engine computes it on the GPU; the
choice itself compares a handful of numbers per step, so it takes plain floats on the host
(no tensor ops: each small torch call costs microseconds where a tiny model's step is a few ms).
`BudgetController` ties them together around one verify, with the gate, exploration and
hysteresis a serving engine needs: the reference loop uses it as is, the SGLang worker through
sglang_plugin/serving_budget.py (CUDA step timing, a lagged read-back of the statistics).

Because the builder's trees are best-first and prefix-closed, one tree built with the largest
candidate budget yields every smaller budget's tree by truncation (`tree.builder.truncate_tree`).
"""

from __future__ import annotations

import bisect
import logging
import statistics
from collections import deque

import torch

logger = logging.getLogger(__name__)


def expected_by_depth_per_request(scores: torch.Tensor, depths: torch.Tensor,
                                  budgets: list[int], max_depth: int) -> torch.Tensor:
    """[bs, len(budgets), max_depth] predicted accepted nodes per request and depth.

    scores [bs, B] best-first prefix log-probabilities (DraftTree.scores), depths [bs, B]
    (1 = child of the root).  Entry (r, i, d-1) = the probability of request r's depth-d
    prefixes among its first budgets[i] nodes, i.e. the chance that r accepts at least d
    tokens with a tree of that budget (budget 0, no draft: nothing).  Fixed shapes, no host
    synchronisation: an engine computes it inside its tree stage."""
    bs, width = scores.shape
    if max(budgets) > width:
        raise ValueError(f"budgets up to {max(budgets)} need a tree of that many nodes; got {width}")
    probs = scores.float().exp()
    onehot = torch.nn.functional.one_hot((depths - 1).clamp(0, max_depth - 1).long(),
                                         max_depth).to(probs.dtype)  # [bs, B, D]
    cum = (probs.unsqueeze(-1) * onehot).cumsum(1)  # [bs, B, D]: the first b nodes
    # plain slices, no index tensor: nothing is copied from the host inside a CUDA graph
    return torch.stack([cum[:, b - 1] if b > 0 else torch.zeros_like(cum[:, 0])
                        for b in budgets], dim=1)


# Candidate budgets of the batch-aware choice below the configured maximum (which is always one):
# a tree smaller than the chain (7) for heavy load, the chain's width (15), then doublings.
CANDIDATE_BUDGETS = (7, 15, 31, 63, 127, 255, 511)


def candidate_budgets(max_budget: int) -> list[int]:
    """The budgets an engine verifies with when none are configured: CANDIDATE_BUDGETS below
    3/4 of the maximum (closer ones cost another set of graphs for little change), and the
    maximum itself."""
    return [b for b in CANDIDATE_BUDGETS if b <= 0.75 * max_budget] + [max_budget]


class DepthCalibration:
    """Per-depth EMA of observed / predicted acceptance (starts at 1: trust the drafter)."""

    def __init__(self, max_depth: int, decay: float = 0.95, device: str | torch.device = "cpu"):
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {decay}")
        self.decay = decay
        self.ratio = torch.ones(max_depth, device=device)
        self._observed = torch.zeros(max_depth, device=device)
        self._predicted = torch.zeros(max_depth, device=device)

    def update(self, predicted: torch.Tensor, accept_lens: torch.Tensor) -> None:
        """predicted [max_depth]: expected requests accepting >= d tokens with the tree that was
        verified; accept_lens [bs]: accepted draft tokens per request (bonus excluded)."""
        d = torch.arange(1, self.ratio.numel() + 1, device=accept_lens.device)
        observed = (accept_lens.view(-1, 1) >= d).sum(0).to(self._observed.dtype)
        self._observed.mul_(self.decay).add_(observed, alpha=1 - self.decay)
        self._predicted.mul_(self.decay).add_(predicted.to(self._predicted.dtype),
                                              alpha=1 - self.decay)
        known = self._predicted > 1e-6
        self.ratio = torch.where(known, self._observed / self._predicted.clamp(min=1e-6),
                                 self.ratio)

    def corrected(self, by_depth: torch.Tensor) -> torch.Tensor:
        """[..., max_depth] predicted acceptance per depth -> calibrated expected accepted
        tokens [...] (each depth's prediction scaled by its observed ratio, capped at 1 per
        request by construction of the inputs)."""
        return (by_depth * self.ratio).sum(-1)


def choose_budget(batch_size: int, expected_accepted, step_ms, current: int | None = None,
                  min_gain: float = 0.0) -> int:
    """Index of the budget with the most committed tokens per millisecond.

    expected_accepted [K]: expected accepted draft tokens summed over the batch, per budget;
    step_ms [K]: the step time of each budget at this batch size (inf = not available); either
    may be a sequence of floats or a 1-D tensor.  Each request also commits its bonus token.
    Ties go to the smaller budget (the first index).  With `current` (an index), the best
    replaces it only if it promises more than `min_gain` (a fraction) over it: estimates
    that differ by less than their noise do not flip the budget from step to step."""
    accepted = _floats(expected_accepted)
    costs = _floats(step_ms)
    rates = [(a + batch_size) / ms for a, ms in zip(accepted, costs)]
    best = max(range(len(rates)), key=lambda i: (rates[i], -i))
    if current is not None and rates[best] <= rates[current] * (1.0 + min_gain):
        return current
    return best


def largest_budget_gain_bound(verify_ms, period_ms: float) -> float:
    """The most any smaller candidate can raise committed tokens per ms over the largest one.

    verify_ms [K]: the verify time of each candidate, ascending budgets (inf = not available);
    period_ms: a step's period with the largest budget.  A smaller tree of the best-first,
    prefix-closed builder never accepts more (its nodes are a subset), so it can win only by
    the verify time it saves: at most saved / (period - saved).  When that is below what the
    cost estimates can resolve, choosing is pure overhead (the testbed server, host-bound:
    verify graphs 0.03 ms apart in a 4-13 ms step)."""
    times = _floats(verify_ms)
    if not times or times[-1] == float("inf"):  # the largest budget's cost is unknown
        return float("inf")
    saved = max(times[-1] - min(times), 0.0)
    return saved / (period_ms - saved) if period_ms > saved else float("inf")


def _floats(x) -> list[float]:
    return x.tolist() if isinstance(x, torch.Tensor) else [float(v) for v in x]


class StepCosts:
    """Measured step time (ms) per (batch size, budget): the cost side of the choice.

    A batch size between measured ones takes the next larger measured one (a conservative
    cost), beyond the largest the largest; a budget without a measurement is never chosen."""

    def __init__(self, table: dict[int, dict[int, float]]) -> None:
        if not table or any(not row for row in table.values()):
            raise ValueError("step costs need at least one batch size with at least one budget")
        for bs, row in table.items():
            for b, ms in row.items():
                if bs < 1 or b < 0 or not ms > 0:
                    raise ValueError(f"step cost of batch {bs}, budget {b} must be a positive "
                                     f"time at batch >= 1, budget >= 0; got {ms}")
        self.table = {int(bs): {int(b): float(ms) for b, ms in row.items()}
                      for bs, row in table.items()}
        self.batches = sorted(self.table)

    def row_ms(self, batch_size: int, budgets: list[int]) -> list[float]:
        """[len(budgets)] step times at this batch size, inf where not measured."""
        measured = self.table[self.batch_row(batch_size)]
        return [measured.get(b, float("inf")) for b in budgets]

    def batch_row(self, batch_size: int) -> int:
        """The measured batch size whose costs stand for `batch_size`."""
        return self.batches[min(bisect.bisect_left(self.batches, batch_size),
                                len(self.batches) - 1)]

    def verify_ms(self, batch_size: int, budgets: list[int]) -> list[float]:
        """The budget-dependent part of each step's cost (here: the whole step)."""
        return self.row_ms(batch_size, budgets)

    @property
    def knows_period(self) -> bool:
        """Whether a step's period is known (a fixed table: always)."""
        return True

    def least_sampled(self, batch_size: int, budgets: list[int]) -> int:
        """The budget to explore: a fixed table learns nothing from it, so the largest."""
        known = [b for b in budgets if b in self.table[self.batch_row(batch_size)]]
        return known[-1]

    @property
    def version(self) -> int:
        """Counts the changes of any cost (a fixed table: never)."""
        return 0


class LiveStepCosts(StepCosts):
    """Step costs for a serving engine, from a startup table of the budget-dependent part (the
    verify pass, timed at startup) and whole-step timings of live steps.

    `observe(batch, budget, ms)` takes a timed step.  A (batch row, budget) cell with at least
    `min_samples` live steps costs the median of its last `window` ones: real contexts and every
    launch included.  Any other cell costs its startup verify time plus the row's remainder (the
    median over the row's steps of step time minus verify time: drafting, tree, acceptance, host
    gaps), so budgets not chosen yet stay comparable; a row without live steps yet takes the
    remainder of the nearest batch size that has one.  The first `skip_first` live steps of
    each cell are not counted and the rest enter medians, because first steps pay one-time work
    (17-81 ms where steady steps take a few, and once minutes: a step that waited on host work
    while other servers on the GPU were starting).
    The startup verify times come from the graphs' capture-time (short) contexts, so only live
    cells see how attention grows with the context; `least_sampled` tells an engine which
    budget to try now and then (ServingBudget explores).  Budget 0 (no draft: the target
    decodes one token) stays out of the remainders, which are a tree step's; until its own
    cell is measured it costs what a tree step's remainder says (pessimistic: it is chosen
    once measured cheaper, never on a guess)."""

    def __init__(self, table: dict[int, dict[int, float]], window: int = 15,
                 min_samples: int = 3, skip_first: int = 1) -> None:
        super().__init__(table)
        if window < 1 or not 1 <= min_samples <= window or skip_first < 0:
            raise ValueError(f"need window >= 1, 1 <= min_samples <= window and skip_first >= 0;"
                             f" got {window}, {min_samples}, {skip_first}")
        self.window, self.min_samples, self.skip_first = window, min_samples, skip_first
        self._rest: dict[int, deque] = {}
        self._cells: dict[tuple[int, int], deque] = {}
        self._seen: dict[tuple[int, int], int] = {}
        self._last: dict[tuple[int, int], int] = {}  # cell -> index of its latest live step
        self._live_steps = 0  # live steps counted so far, all cells
        self._medians: dict[tuple[int, int], float] = {}  # sampled cells, kept on observe
        self.rest_ms: dict[int, float] = {}
        self._version = 0  # counts the observations that changed a cost

    def observe(self, batch_size: int, budget: int, step_ms: float) -> None:
        key = self.batch_row(batch_size)
        verify = self.table[key].get(budget)
        if verify is None or not step_ms > 0:
            return
        seen = self._seen[(key, budget)] = self._seen.get((key, budget), 0) + 1
        if seen <= self.skip_first:
            return
        if budget > 0:  # a step without a draft has no draft or tree in its remainder
            rest = self._rest.setdefault(key, deque(maxlen=self.window))
            rest.append(max(step_ms - verify, 0.0))
            self.rest_ms[key] = statistics.median(rest)
        cell = self._cells.setdefault((key, budget), deque(maxlen=self.window))
        cell.append(step_ms)
        if len(cell) >= self.min_samples:
            self._medians[(key, budget)] = statistics.median(cell)
        self._live_steps += 1
        self._last[(key, budget)] = self._live_steps
        self._version += 1

    @property
    def version(self) -> int:
        return self._version

    @property
    def knows_period(self) -> bool:
        """Whether any live step has been timed (before that, the startup table holds verify
        times only, not what a step takes)."""
        return bool(self.rest_ms)

    def row_ms(self, batch_size: int, budgets: list[int]) -> list[float]:
        key = self.batch_row(batch_size)
        rest = self._rest_of(key)
        return [self._medians.get((key, b), ms + rest)
                for b, ms in zip(budgets, self.verify_ms(batch_size, budgets))]

    def verify_ms(self, batch_size: int, budgets: list[int]) -> list[float]:
        """The startup (verify-only) costs of this batch row, inf where not measured."""
        return StepCosts.row_ms(self, batch_size, budgets)

    def _rest_of(self, key: int) -> float:
        """The remainder of batch row `key`, else of the nearest row with one (0 before any)."""
        if key in self.rest_ms:
            return self.rest_ms[key]
        if not self.rest_ms:
            return 0.0
        return self.rest_ms[min(self.rest_ms, key=lambda k: (abs(k - key), k))]

    def least_sampled(self, batch_size: int, budgets: list[int]) -> int:
        """The measured budget of this batch row to explore: the one with the fewest live
        steps, and among full windows the one measured longest ago (so no cell's median
        goes stale while another is refreshed), the smallest on ties."""
        key = self.batch_row(batch_size)
        known = [b for b in budgets if b in self.table[key]]
        return min(known, key=lambda b: (len(self._cells.get((key, b), ())),
                                         self._last.get((key, b), -1), b))


class BudgetController:
    """The batch-aware budget: per decode batch, verify the tree cut to the candidate budget
    that commits the most tokens per millisecond, and learn from what the target accepts.

    Engine-agnostic.  The caller builds the largest candidate's tree, passes the expected
    accepted tokens per request of every candidate (`calibrated`, from the drafter's
    predictions, possibly an earlier step's: an engine reads them back without waiting) to
    `choose`, and after the verify gives `observe` the predictions and what was accepted.

    The gate: a smaller tree never accepts more than the largest (the builder's trees are
    nested), so it can win only by the verify time it saves.  Where that cannot reach
    `min_gain` of the step period (largest_budget_gain_bound) the batch size verifies the
    largest budget with no choice, statistics or exploration, the same work as a pinned
    budget; where the choice runs, a chosen budget is replaced only by one promising more
    than `min_gain` over it.  Budget 0 (no speculation: the target decodes one token, nothing
    is drafted) saves the draft too, which no verify-time bound sees: with it among the
    candidates every batch size chooses once a step period is known.  One step in
    `explore_every` (0: never) of an engaged batch size
    verifies the least-measured budget, and `stats_every` subsamples the statistics (they
    move slowly; a subsample, not a bias).  `gate=False` engages every batch size once a
    step period is known (for steps whose cost the verify-time bound does not capture)."""

    def __init__(self, budgets: list[int], costs: StepCosts, max_depth: int, device="cpu", *,
                 min_gain: float = 0.0, explore_every: int = 0, stats_every: int = 1,
                 decay: float = 0.95, expected_decay: float = 0.9, log: bool = True,
                 gate: bool = True) -> None:
        if not budgets or sorted(set(budgets)) != list(budgets) or budgets[0] < 0:
            raise ValueError(f"budgets must be distinct, ascending and >= 0; got {budgets}")
        if budgets[-1] < 1:
            raise ValueError(f"the largest budget must be >= 1; got {budgets}")
        if explore_every < 0 or stats_every < 1 or min_gain < 0:
            raise ValueError(f"need explore_every >= 0, stats_every >= 1 and min_gain >= 0; got "
                             f"{explore_every}, {stats_every}, {min_gain}")
        self.budgets = list(budgets)
        self.costs = costs
        self.min_gain, self.explore_every, self.stats_every = min_gain, explore_every, stats_every
        self.gate = gate
        self.expected_decay, self.log = expected_decay, log
        self.calibration = DepthCalibration(max_depth, decay, device)
        self.expected = torch.zeros(len(budgets), device=device)  # per request, EMA
        self._seen = False
        self._observed = 0
        self._gate: dict[int, tuple[int, bool]] = {}  # cost row -> (costs.version, engaged)
        self._announced: dict[int, bool] = {}  # cost row -> the judgement last logged
        self._row_steps: dict[int, int] = {}
        self._last_choice: dict[int, int] = {}  # cost row -> budget
        self.steps = dict.fromkeys(self.budgets, 0)

    def calibrated(self, depth_probs: torch.Tensor) -> torch.Tensor:
        """depth_probs [bs, K, D] (tree stage: expected_by_depth_per_request) -> [K] the
        calibrated expected accepted draft tokens per request of every candidate."""
        return self.calibration.corrected(depth_probs.sum(0)) / depth_probs.shape[0]

    def choose(self, bs: int, expected: list[float] | None) -> int:
        """The budget for a batch of `bs` requests (host floats only).  expected [K]: the
        expected accepted tokens per request of each candidate, None before any is known."""
        largest = self.budgets[-1]
        row = self.costs.batch_row(bs)
        if not self.engaged(bs, row) or expected is None:
            return largest
        self._row_steps[row] = self._row_steps.get(row, 0) + 1
        if self.explore_every and self._row_steps[row] % self.explore_every == 0:
            return self.costs.least_sampled(bs, self.budgets)
        step_ms = self.costs.row_ms(bs, self.budgets)
        current = self.budgets.index(self._last_choice.get(row, largest))
        budget = self.budgets[choose_budget(bs, [e * bs for e in expected], step_ms, current,
                                            self.min_gain)]
        if self._last_choice.get(row, largest) != budget:
            self._last_choice[row] = budget
            if self.log:
                logger.info("DDTREE budget: batch size %d -> B=%d (expected accepted per request "
                            "%s, step ms %s over budgets %s)", bs, budget,
                            [round(x, 2) for x in expected], [round(x, 2) for x in step_ms],
                            self.budgets)
        return budget

    def engaged(self, bs: int, row: int | None = None) -> bool:
        """Whether the choice can matter at this batch size: some smaller candidate could gain
        at least min_gain over the largest (from the verify times and the row's step period;
        before a period is known, no).  Re-judged only when a cost changed."""
        row = self.costs.batch_row(bs) if row is None else row
        if not self.gate or self.budgets[0] == 0:
            return self.costs.knows_period
        version = self.costs.version
        cached = self._gate.get(row)
        if cached is not None and cached[0] == version:
            return cached[1]
        if self.min_gain > 0 and not self.costs.knows_period:
            self._gate[row] = (version, False)
            return False
        verify = self.costs.verify_ms(bs, self.budgets)
        period = self.costs.row_ms(bs, self.budgets[-1:])[0]
        bound = largest_budget_gain_bound(verify, period)
        engaged = bound >= self.min_gain
        if self._announced.get(row) != engaged:
            self._announced[row] = engaged
            if self.log:
                logger.info("DDTREE budget: batch size %d %s: a smaller tree can gain at most "
                            "%.1f%% over B=%d (verify ms %s, step %.2f ms; least gain acted on "
                            "%.3g)", bs, "chooses per step" if engaged else
                            "verifies the largest budget", 100 * bound, self.budgets[-1],
                            [round(x, 3) for x in verify], period, self.min_gain)
            if not engaged:
                self._last_choice.pop(row, None)
        self._gate[row] = (version, engaged)
        return engaged

    def observe(self, bs: int, budget: int, depth_probs: torch.Tensor,
                accepted: torch.Tensor) -> torch.Tensor | None:
        """After a verify of `budget` (tensor work only, no host read).  depth_probs
        [bs, K, D]: the candidates' predictions (None after a step without a draft, budget 0:
        it predicts nothing and teaches nothing); accepted [bs]: draft tokens each request
        accepted (bonus excluded).  Returns the updated expected accepted tokens per request
        of every candidate [K], or None where no statistics ran this step."""
        self.steps[budget] += 1
        if budget == 0:
            return None
        cached = self._gate.get(self.costs.batch_row(bs))
        if cached is not None and not cached[1]:  # no choice at this batch size
            return None
        self._observed += 1
        if self._observed % self.stats_every and self._seen:
            return None
        predicted = depth_probs.sum(0)  # [K, D]
        self.calibration.update(predicted[self.budgets.index(budget)], accepted)
        per_request = self.calibration.corrected(predicted) / bs
        if self._seen:
            self.expected.mul_(self.expected_decay).add_(per_request,
                                                         alpha=1 - self.expected_decay)
        else:
            self.expected.copy_(per_request)
            self._seen = True
        return self.expected
