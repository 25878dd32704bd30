"""The decode step's host work, measured on the CPU: microseconds per stage and the tensor ops
DDTREE issues outside its graphed stages, per decode step.

On a GPU every tensor op outside a CUDA graph is a kernel launch the host pays for (several
microseconds each), whatever the op computes; at batch 1 on a small target those launches set
the step's floor.  Here the real `DecodeStep` runs over the real `DFlashModelIO`, with what
DFLASH does as well stood in (the drafter and target forwards, SGLang's verify preparation, the
draft-KV write, the KV-move kernel) and the graphed stages replaced by what they cost the host:
the tree stage nothing (it runs in the draft graph's tail), the accept stage one replay (its
inputs and outputs live in fixed buffers): the ops counted are the ones DDTREE adds to DFLASH's
step.  Ops are counted with a TorchDispatchMode (every aten op, views included: a view costs no
launch on the GPU but host time all the same).
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

VOCAB, HIDDEN, BLOCK, ROW = 512, 64, 16, 4096  # vocab, drafter width, draft block, KV row


class OpCounter(TorchDispatchMode):
    """Counts aten ops while not paused (ops still run when paused)."""

    def __init__(self) -> None:
        super().__init__()
        self.count, self.paused, self.by_op = 0, 0, Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused:
            self.count += 1
            self.by_op[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))

    @contextmanager
    def pause(self):
        self.paused += 1
        try:
            yield
        finally:
            self.paused -= 1


class ReplayStandIn:
    """A captured graph as the host sees its replay: one launch (counted once).  What the graph
    computes runs once, uncounted, for its outputs: on a GPU the host pays nothing for it."""

    def __init__(self, fn: Callable[[], None], counter: OpCounter) -> None:
        self.fn, self.counter, self.ran = fn, counter, False

    def replay(self) -> None:
        if not self.ran:
            with self.counter.pause():
                self.fn()
            self.ran = True
        self.counter.count += 1


def _paused(counter: OpCounter, fn: Callable, launches: int = 0) -> Callable:
    """`fn` run with counting paused (DFLASH's work too), counted as `launches` ops."""
    def run(*args, **kwargs):
        with counter.pause():
            out = fn(*args, **kwargs)
        counter.count += launches
        return out
    return run


def fake_worker(bs_max: int, counter: OpCounter):
    """A DFLASH worker's surface as DFlashModelIO reads it, with stand-in models."""
    feats: dict[int, torch.Tensor] = {}

    def target_forward(batch, forward_batch, is_verify):
        rows = forward_batch.rows
        if rows not in feats:
            feats[rows] = (torch.randn(rows, VOCAB), torch.randn(rows, HIDDEN))
        logits, hidden = feats[rows]
        return SimpleNamespace(logits_output=SimpleNamespace(
            next_token_logits=logits, hidden_states=hidden, customized_info=None))

    pool = SimpleNamespace(req_to_token=torch.arange(bs_max * ROW, dtype=torch.int32).view(
        bs_max, ROW))
    runner = SimpleNamespace(req_to_token_pool=pool, token_to_kv_pool_allocator=None,
                             attn_backend="backend", decode_cuda_graph_runner="graphs")
    return SimpleNamespace(
        target_worker=SimpleNamespace(model_runner=runner,
                                      forward_batch_generation=_paused(counter, target_forward)),
        model_runner=runner, device="cpu",
        _append_target_hidden_to_draft_kv_by_loc=_paused(counter, lambda **kw: None, 1))


def make_batch(bs: int) -> SimpleNamespace:
    from ddtree_sglang.sglang_plugin.draft_input import make_draft_input

    seq = torch.full((bs,), 200, dtype=torch.int64)
    req = SimpleNamespace(sampling_params=SimpleNamespace(
        frequency_penalty=0.0, presence_penalty=0.0, repetition_penalty=1.0, min_new_tokens=0,
        stop_token_ids=None, sampling_seed=None, logit_bias=None))
    return SimpleNamespace(
        seq_lens=seq, seq_lens_cpu=seq.clone(), seq_lens_sum=int(seq.sum()),
        spec_info=make_draft_input(torch.zeros(bs, dtype=torch.int64), seq),
        has_grammar=False, reqs=[req] * bs, sampling_info=None,
        req_pool_indices=torch.arange(bs), return_logprob=False, top_logprobs_nums=None,
        token_ids_logprobs=None, out_cache_loc=None, device="cpu")


@contextmanager
def sglang_stand_ins(counter: OpCounter):
    """SGLang's calls that DFLASH makes too, stood in for the duration (not counted but for
    their kernel launches): the draft block's preparation and forward, the verify preparation."""
    from ddtree_sglang.sglang_plugin import sglang_api as sg

    saved = {k: getattr(sg, k) for k in ("prepare_dflash_draft_block", "ForwardBatch",
                                         "eagle_prepare_for_verify")}

    def prepare_verify(verify_input, req_to_token_pool, batch, target_worker):
        rows = verify_input.draft_token.shape[0]
        batch.out_cache_loc = torch.arange(rows)
        return SimpleNamespace(rows=rows), True

    sg.prepare_dflash_draft_block = _paused(counter, lambda **kw: None, 1)
    sg.ForwardBatch = _paused(counter, lambda **kw: SimpleNamespace(**kw))
    sg.eagle_prepare_for_verify = _paused(counter, prepare_verify, 3)
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(sg, k, v)


def build_step(bs_max: int, budget: int, budgets: tuple[int, ...], counter: OpCounter):
    """The real DecodeStep over the real DFlashModelIO (fake worker), graphed stages stood in."""
    from ddtree_sglang.budget.controller import BudgetController, LiveStepCosts
    from ddtree_sglang.kernels.choice import Kernels
    from ddtree_sglang.sglang_plugin.serving_budget import ServingBudget
    from ddtree_sglang.sglang_plugin.decode_step import DecodeStep
    from ddtree_sglang.sglang_plugin import graphed_stages
    from ddtree_sglang.sglang_plugin.graphed_stages import GraphedStages
    from ddtree_sglang.sglang_plugin.grammar_stage import MaskCosts
    from ddtree_sglang.sglang_plugin.model_io import DFlashModelIO, draft_logits
    from ddtree_sglang.sglang_plugin.request_state import PenaltyState
    from ddtree_sglang.sglang_plugin.settings import DDTreeSettings

    env = {"SGLANG_DDTREE_BUDGETS": ",".join(map(str, budgets)) if len(budgets) > 1 else "off"}
    settings = DDTreeSettings.from_values(budget, BLOCK, env)
    lm_head = SimpleNamespace(weight=torch.randn(VOCAB, HIDDEN))
    stages = GraphedStages(Kernels(), budget, BLOCK - 1, BLOCK,
                           lambda h: draft_logits(lm_head, h, VOCAB), settings.budgets,
                           max_bs=bs_max, hidden_size=HIDDEN)
    saved = graphed_stages.capture_graph, torch.cuda.graph_pool_handle
    graphed_stages.capture_graph = lambda fn, pool: ReplayStandIn(fn, counter)
    torch.cuda.graph_pool_handle = lambda: None
    try:
        stages.accept.capture(range(1, bs_max + 1))
    finally:
        graphed_stages.capture_graph, torch.cuda.graph_pool_handle = saved
    worker = fake_worker(bs_max, counter)
    hidden = torch.randn(bs_max, BLOCK, HIDDEN)
    io = DFlashModelIO(worker, Kernels(), BLOCK, budget + 1, VOCAB)
    trees: dict[int, tuple] = {}

    def draft_block(batch, draft_input):  # the draft graph, its tail building the trees
        bs = len(batch.seq_lens)
        if bs not in trees:  # what the tail computes, once: on a GPU the host pays nothing
            trees[bs] = stages.tree._tree(hidden[:bs, 1:], draft_input.bonus_tokens,
                                          batch.seq_lens)
            stages.tree.out.write(trees[bs], bs)
        return hidden[:bs], True

    io.draft_block = _paused(counter, draft_block, 1)
    io._kv_move_buffers = ("ptrs", "row bytes", 0)
    io.kernels = SimpleNamespace(move_kv_rows=_paused(counter, lambda *a: None, 1))
    controller = None
    if len(settings.budgets) > 1:
        table = {b: {c: 1.0 + 0.01 * c for c in settings.budgets} for b in (1, 8, 64)}
        controller = ServingBudget(
            BudgetController(list(settings.budgets), LiveStepCosts(table), BLOCK - 1,
                             min_gain=settings.min_gain, explore_every=settings.explore_every,
                             log=False),
            {c + 1: ("backend", "graphs") for c in settings.budgets})
    return DecodeStep(settings, VOCAB, io, stages, PenaltyState(bs_max, VOCAB, "cpu"),
                      MaskCosts(), controller)


class StageTimes:
    """The step clock's interface (host_timing.StageClock), keeping every step's stage times
    and the ops counted in each stage."""

    def __init__(self, counter: OpCounter) -> None:
        self.counter = counter
        self.steps: list[dict[str, float]] = []
        self.ops: list[dict[str, int]] = []
        self._last, self._count = 0.0, 0

    def start(self, bs: int) -> None:
        self.steps.append({})
        self.ops.append({})
        self._last, self._count = time.perf_counter(), self.counter.count

    def mark(self, stage: str) -> None:
        now = time.perf_counter()
        self.steps[-1][stage] = self.steps[-1].get(stage, 0.0) + (now - self._last) * 1e6
        self.ops[-1][stage] = self.counter.count - self._count
        self._last, self._count = now, self.counter.count

    def end(self) -> None:
        self.mark("rest")


def measure(bs: int, budget: int, budgets: tuple[int, ...], steps: int = 200,
            warmup: int = 20) -> dict:
    """Median host µs per stage and per step over `steps` decode steps of a batch of `bs`
    (timed without the op counter, whose Python hook would inflate every op), then the tensor
    ops outside graphed stages per step and per stage, counted over a few more steps."""
    counter = OpCounter()
    step = build_step(max(bs, 1), budget, budgets, counter)
    clock = StageTimes(counter)
    step.clock = clock
    with sglang_stand_ins(counter), torch.inference_mode():
        for _ in range(warmup + steps):
            step.run(make_batch(bs))
        timed = clock.steps[warmup:]
        counted = []
        for _ in range(5):
            batch = make_batch(bs)
            counter.count, counter.by_op = 0, Counter()
            with counter:
                step.run(batch)
            counted.append((counter.count, counter.by_op, clock.ops[-1]))
    stages = {k: round(statistics.median(s[k] for s in timed), 1) for k in timed[0]}
    totals = [sum(s.values()) for s in timed]
    return dict(bs=bs, budget=budget, budgets=list(budgets), steps=steps,
                host_us=round(statistics.median(totals), 1), stages_us=stages,
                ops=statistics.median(n for n, _, _ in counted), stage_ops=counted[-1][2],
                top_ops=counted[-1][1].most_common(10))
