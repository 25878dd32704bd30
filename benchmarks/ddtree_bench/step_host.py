"""The decode step's host work, counted on the CPU: the Python function calls and the tensor ops a
decode step dispatches, DDTREE's and DFLASH's, through their real worker code with the GPU work
stood in.

On a GPU every tensor op outside a CUDA graph is a kernel launch the host pays for (several
microseconds each), and every Python call between launches is host time too; at batch 1 on a
small target that host work sets the step's floor.  Here a decode step runs through the real
`forward_batch_generation` of each worker: DDTreeWorker's (the real `DecodeStep` over the real
`DFlashModelIO`) and SGLang's own DFlashWorkerV2's, both built without their __init__ (which loads
models) and given the same stand-ins (`StandIn`) for what runs on the GPU or needs a live server:
the drafter and target forwards (graph replays), the target's embeddings, SGLang's verify
preparation, the draft-block, accept/bonus, KV-move and draft-KV kernels, and the CUDA-only
record_stream.  DDTREE's graphed stages cost the host what a graph costs: the tree stage nothing
(it runs in the draft graph's tail), the accept stage one replay.

Counted per decode step, exactly (the same run to run; a test holds them to a committed
baseline): Python-level calls (`CallCounter`, sys.setprofile: 'call' events, by module and by
function; 'c_call' events, builtins and torch functions, by the module that calls them), with a
stand-in counted as one call and nothing inside it; aten ops dispatched outside stand-ins and
graphs (`OpCounter`, views included: a view costs no launch on the GPU but host time all the
same), beside the launches the stand-ins are taken to make (`stood_in`, an assumption per
stand-in).  Both over a window of steps after the batch-aware budget has settled: its step timer
reads a fixed clock (`fixed_step_timer`), so its choices are the same every run.  Host µs per
step are measured too; on a shared CPU they are noise, not evidence.
"""

from __future__ import annotations

import gc
import itertools
import statistics
import sys
import sysconfig
import time
from collections import Counter
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, SimpleNamespace
from typing import Any, Callable, Iterator
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode

VOCAB, HIDDEN, BLOCK, ROW = 512, 64, 16, 4096  # vocab, drafter width, draft block, KV row
SEQ_LEN = 200  # every request's committed length
STEP_MS = 5.0  # the step period the batch-aware budget's timer reads (it chooses per step)
HARNESS = __file__  # frames of this file are stand-ins (or the harness itself)
STAND_INS = "<stand-ins>"
ROOT = Path(__file__).resolve().parents[2]
PLACES = ((Path(torch.__file__).resolve().parents[1], ""),  # site-packages: sglang/, torch/
          (Path(sysconfig.get_paths()["stdlib"]).resolve(), "python/"), (ROOT, ""))
DDTREE = {"DDTREE pinned B=32": (32,), "DDTREE batch-aware 7,15,32": (7, 15, 32)}  # budgets
DFLASH = "DFLASH (SGLang)"
VARIANTS = (*DDTREE, DFLASH)


class OpCounter(TorchDispatchMode):
    """Counts aten ops while not paused (ops still run when paused); `stood_in` counts the
    launches stand-ins are taken to make."""

    def __init__(self) -> None:
        super().__init__()
        self.count, self.views, self.stood_in, self.paused = 0, 0, 0, 0
        self.by_op: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused:
            self.count += 1
            self.views += func.is_view
            self.by_op[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))

    def reset(self) -> None:
        self.count, self.views, self.stood_in, self.by_op = 0, 0, 0, Counter()

    @contextmanager
    def pause(self) -> Iterator[None]:
        self.paused += 1
        try:
            yield
        finally:
            self.paused -= 1


class StandIn:
    """What a model, a kernel or a server-bound SGLang call does, run with counting paused;
    what the host pays for it: one Python call and `launches` ops."""

    def __init__(self, name: str, fn: Callable, counter: OpCounter, launches: int = 0) -> None:
        self.name, self.fn, self.counter, self.launches = name, fn, counter, launches

    def __call__(self, *args, **kwargs):
        with self.counter.pause():
            out = self.fn(*args, **kwargs)
        self.counter.stood_in += self.launches
        return out

    def as_method(self) -> Callable:
        """This stand-in as a method: a function, which binds without a Python call."""
        def method(*args, **kwargs):
            return self(*args, **kwargs)
        return method


class ReplayStandIn:
    """A captured graph as the host sees its replay: one launch.  What the graph computes runs
    once, uncounted, for its outputs (the same every step here: the step's inputs are)."""

    name = "graph replay"

    def __init__(self, fn: Callable[[], None], counter: OpCounter) -> None:
        self.fn, self.counter, self.ran = fn, counter, False

    def replay(self) -> None:
        if not self.ran:
            with self.counter.pause():
                self.fn()
            self.ran = True
        self.counter.stood_in += 1


class CallCounter:
    """Python-level calls ('call' events: functions, methods, comprehensions, generator
    resumptions) by (file, function) and builtin calls ('c_call') by (calling file, name),
    through sys.setprofile, over the steps run by `run`.  A call into this file is a stand-in:
    one call, nothing inside it counted.  The garbage collector is off meanwhile, so no
    finaliser's calls land in a step."""

    def __init__(self) -> None:
        self.calls: Counter = Counter()
        self.c_calls: Counter = Counter()
        self.per_step: list[int] = []
        self._inside = None  # the stand-in's frame being run

    def _hook(self, frame: FrameType, event: str, arg) -> None:
        if self._inside is not None:
            if event == "return" and frame is self._inside:
                self._inside = None
            return
        filename = frame.f_code.co_filename
        if event == "call":
            if filename == HARNESS:
                self._inside = frame
                self.calls[(STAND_INS, stand_in_name(frame))] += 1
            else:
                self.calls[where(frame)] += 1
        elif event == "c_call" and filename != HARNESS:
            self.c_calls[(where(frame)[0], builtin_name(arg))] += 1

    def run(self, fn: Callable, *args) -> None:
        """fn(*args), counted (the harness's own call into it and out of it is not)."""
        before = self.calls.total()
        gc.disable()
        sys.setprofile(self._hook)
        try:
            fn(*args)
        finally:
            sys.setprofile(None)
            gc.enable()
        self.per_step.append(self.calls.total() - before)


def where(frame: FrameType) -> tuple[str, str]:
    """(file, function) of a frame; a dataclass's generated method (compiled from a string)
    is its class's."""
    code = frame.f_code
    if code.co_filename == "<string>" and "self" in frame.f_locals:
        cls = type(frame.f_locals["self"])
        return sys.modules[cls.__module__].__file__, f"{cls.__qualname__}.{code.co_name}"
    return code.co_filename, code.co_qualname


def builtin_name(fn) -> str:
    """A builtin's qualified name (Tensor.view), or its bare name where the qualifier is a
    binding library's internal type (pybind11's)."""
    qualname = getattr(fn, "__qualname__", fn.__name__)
    return fn.__name__ if qualname.startswith("pybind11") else qualname


def stand_in_name(frame: FrameType) -> str:
    """The name of the stand-in a frame of this file runs (its own, or the one it calls)."""
    for value in frame.f_locals.values():
        if isinstance(value, (StandIn, ReplayStandIn)):
            return value.name
    return frame.f_code.co_name


def module_of(filename: str) -> str:
    """A source file as a reader names it: src/ddtree_sglang/..., sglang/..., torch/...,
    python/<stdlib module>, <frozen module>, <stand-ins>."""
    if filename.startswith("<"):
        return filename
    path = Path(filename).resolve()
    for base, label in PLACES:
        if path.is_relative_to(base):
            return label + str(path.relative_to(base))
    return filename


def per_step(counts: Counter, steps: int, key: Callable) -> dict[str, float]:
    """Counts summed by key(file, name), per step, largest first."""
    out: Counter = Counter()
    for (filename, name), n in counts.items():
        out[key(filename, name)] += n
    return {k: n / steps for k, n in out.most_common()}


def stand_in_worker(cls: type, bs_max: int, counter: OpCounter,
                    tree_tail: Callable | None = None):
    """A `cls` (DFlashWorkerV2 or a subclass) without its __init__, holding what DFLASH's decode
    path reads, its models stood in: the drafter's forward (a graph replay, its tail `tree_tail`
    run once per batch size: the step's inputs are the same every step), the target's verify
    forward (a replay), its embeddings, the draft-KV append."""
    from sglang.srt.speculative.draft_worker_common import make_draft_block_spec_info

    states = torch.randn(bs_max, BLOCK, HIDDEN)
    logits: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    tails_run: set[int] = set()

    def draft_forward(forward_batch):
        bs = forward_batch.batch_size
        out = SimpleNamespace(hidden_states=states[:bs].reshape(bs * BLOCK, HIDDEN))
        if tree_tail is not None and bs not in tails_run:
            tree_tail(None, out, forward_batch, bs * BLOCK)
            tails_run.add(bs)
        return SimpleNamespace(logits_output=out, can_run_graph=True)

    def target_forward(batch, forward_batch, is_verify, **kwargs):
        rows = forward_batch.rows
        if rows not in logits:
            logits[rows] = (torch.randn(rows, VOCAB), torch.randn(rows, HIDDEN))
        next_logits, hidden = logits[rows]
        return SimpleNamespace(can_run_cuda_graph=True, logits_output=SimpleNamespace(
            next_token_logits=next_logits, hidden_states=hidden, customized_info=None))

    embed = StandIn("embeddings", lambda ids: torch.zeros(*ids.shape, HIDDEN), counter, 1)
    model = SimpleNamespace(get_input_embeddings=StandIn("get_input_embeddings",
                                                         lambda: embed, counter),
                            lm_head=SimpleNamespace(weight=torch.randn(VOCAB, HIDDEN)))
    pool = SimpleNamespace(req_to_token=torch.arange(bs_max * ROW, dtype=torch.int32).view(
        bs_max, ROW))
    runner = SimpleNamespace(req_to_token_pool=pool, token_to_kv_pool_allocator=None,
                             attn_backend="backend", decode_cuda_graph_runner="graphs",
                             model=model)
    worker = object.__new__(cls)
    vars(worker).update(
        _target_worker=SimpleNamespace(model_runner=runner, forward_batch_generation=StandIn(
            "target forward", target_forward, counter, 1)),
        model_runner=runner, device="cpu", block_size=BLOCK, _mask_token_id=VOCAB - 1,
        draft_model_runner=SimpleNamespace(forward=StandIn("draft forward", draft_forward,
                                                           counter, 1)),
        _append_target_hidden_to_draft_kv_by_loc=StandIn("draft-KV append", lambda **kw: None,
                                                          counter, 1),
        _draft_block_spec_info=make_draft_block_spec_info(draft_token_num=BLOCK, device="cpu"),
        _draft_block_ids_buf=None, _draft_block_positions_buf=None,
        _draft_block_tokens_buf=None, _draft_verify_out_cache_loc_buf=None,
        _draft_block_end_buf=None, _draft_seq_lens_cpu_buf=None,
        use_compact_draft_cache=False, _need_mamba_verify_commit=False,
        _use_triton_prepare_block=True, _use_triton_accept_bonus=True,  # as on a GPU
        _warned_sampling_fallback=False, _accept_bonus_buffer_cap=0,
        _accept_bonus_buffer_slot=0, _accept_len_buf=None, _commit_lens_bufs=[],
        _bonus_id_bufs=[], _out_tokens_bufs=[], _new_seq_lens_bufs=[])
    return worker


def prepare_draft_block(*, bonus_tokens, prefix_lens, req_pool_indices, req_to_token,
                        block_ids_out, positions_out, cache_loc_out, mask_token_id) -> None:
    """SGLang's draft-block kernel (_prepare_dflash_draft_block_unchecked), in torch."""
    block_ids_out.fill_(mask_token_id)
    block_ids_out[:, 0] = bonus_tokens
    torch.add(prefix_lens[:, None], torch.arange(block_ids_out.shape[1]), out=positions_out)
    cache_loc_out.copy_(req_to_token[req_pool_indices[:, None], positions_out])


def eagle_prepare_for_verify(verify_input, req_to_token_pool, batch, target_worker):
    """SGLang's EAGLE verify preparation as DDTREE reads it: the tree's KV slots on the batch,
    a forward batch, graphed."""
    rows = verify_input.draft_token.shape[0]
    batch.out_cache_loc = torch.arange(rows)
    return SimpleNamespace(rows=rows), True


def dflash_prepare_for_verify(verify_input, batch, target_worker):
    """DFlashVerifyInput.prepare_for_verify as DFLASH reads it: a forward batch, graphed."""
    return SimpleNamespace(rows=verify_input.draft_token.shape[0]), True


@contextmanager
def sglang_stand_ins(counter: OpCounter) -> Iterator[None]:
    """SGLang's kernels and server-bound calls that the two steps make, stood in for the
    duration (both workers' names for them): the draft-block kernel, the verify preparations
    (the cache-slot kernel, the forward batch and the graph's inputs: 3 launches for EAGLE's,
    2 for DFLASH's, whose slots the draft-block kernel wrote), DFLASH's accept/bonus kernel,
    and record_stream (CUDA only)."""
    from sglang.srt.speculative import dflash_worker_v2 as dflash
    from sglang.srt.speculative.dflash_info import DFlashVerifyInput
    from ddtree_sglang.sglang_plugin import sglang_api as sg

    block = StandIn("draft-block kernel", prepare_draft_block, counter, 1)
    patched = [(sg, "prepare_dflash_draft_block", block),
               (dflash, "_prepare_dflash_draft_block_unchecked", block),
               (sg, "eagle_prepare_for_verify",
                StandIn("EAGLE verify preparation", eagle_prepare_for_verify, counter, 3)),
               (DFlashVerifyInput, "prepare_for_verify",
                StandIn("DFLASH verify preparation", dflash_prepare_for_verify, counter,
                        2).as_method()),
               (dflash, "_compute_dflash_accept_bonus_triton_unchecked",
                StandIn("accept/bonus kernel", lambda **kw: None, counter, 1)),
               (torch.Tensor, "record_stream",
                StandIn("record_stream", lambda tensor, stream: None, counter, 1).as_method())]
    with ExitStack() as stack:
        for owner, name, stand_in in patched:
            stack.enter_context(mock.patch.object(owner, name, stand_in))
        yield


def fixed_step_timer(serving_budget, counter: OpCounter, period_ms: float = STEP_MS) -> None:
    """The batch-aware budget's step timer reads a clock that advances `period_ms` per step
    (each step starts one mark), so what it learns, and chooses, is the same every run."""
    from ddtree_sglang.sglang_plugin.serving_budget import _HostMark

    marks = itertools.count()

    def mark() -> _HostMark:
        made = _HostMark()
        made.t = next(marks) * period_ms / 1e3
        return made

    serving_budget._timer._mark = StandIn("step timer mark (CUDA event)", mark, counter)


def build_ddtree(bs_max: int, budget: int, budgets: tuple[int, ...], counter: OpCounter):
    """A DDTreeWorker over stand-ins: its real DecodeStep over the real DFlashModelIO, the
    tree stage in the draft graph's tail, the accept stage's graphs replays; the batch-aware
    budget (more than one candidate) built as build_serving_budget builds it, its startup
    verify times a fixed table."""
    from ddtree_sglang.budget.controller import BudgetController, LiveStepCosts
    from ddtree_sglang.kernels.choice import Kernels
    from ddtree_sglang.sglang_plugin import graphed_stages
    from ddtree_sglang.sglang_plugin.decode_step import DecodeStep
    from ddtree_sglang.sglang_plugin.grammar_stage import MaskCosts
    from ddtree_sglang.sglang_plugin.graphed_stages import GraphedStages
    from ddtree_sglang.sglang_plugin.model_io import DFlashModelIO, draft_logits
    from ddtree_sglang.sglang_plugin.request_state import PenaltyState
    from ddtree_sglang.sglang_plugin.serving_budget import ServingBudget
    from ddtree_sglang.sglang_plugin.settings import DDTreeSettings
    from ddtree_sglang.sglang_plugin.worker import DDTreeWorker

    env = {"SGLANG_DDTREE_BUDGETS": ",".join(map(str, budgets)) if len(budgets) > 1 else "off"}
    settings = DDTreeSettings.from_values(budget, BLOCK, env)
    lm_head = SimpleNamespace(weight=torch.randn(VOCAB, HIDDEN))
    stages = GraphedStages(Kernels(), budget, BLOCK - 1, BLOCK,
                           lambda h: draft_logits(lm_head, h, VOCAB), settings.budgets,
                           max_bs=bs_max, hidden_size=HIDDEN)
    with mock.patch.object(graphed_stages, "capture_graph",
                           lambda fn, pool: ReplayStandIn(fn, counter)), \
            mock.patch.object(torch.cuda, "graph_pool_handle", lambda: None):
        stages.accept.capture(range(1, bs_max + 1))
    worker = stand_in_worker(DDTreeWorker, bs_max, counter, stages.tree.tail_hook)
    io = DFlashModelIO(worker, Kernels(), BLOCK, budget + 1, VOCAB, tree_in_draft_graph=True)
    io._kv_move_buffers = ("ptrs", "row bytes", 0)
    io.kernels = SimpleNamespace(move_kv_rows=StandIn("KV-move kernel", lambda *a: None,
                                                      counter, 1))
    serving_budget = None
    if len(settings.budgets) > 1:
        table = {b: {c: 1.0 + 0.01 * c for c in settings.budgets} for b in (1, 8, 64)}
        serving_budget = ServingBudget(
            BudgetController(list(settings.budgets), LiveStepCosts(table), BLOCK - 1,
                             min_gain=settings.min_gain, explore_every=settings.explore_every,
                             stats_every=4, log=False),
            {c + 1: ("backend", "graphs") for c in settings.budgets})
        fixed_step_timer(serving_budget, counter)
    worker.ddtree_step = DecodeStep(settings, VOCAB, io, stages,
                                    PenaltyState(bs_max, VOCAB, "cpu"), MaskCosts(),
                                    serving_budget)
    return worker


def build_dflash(bs_max: int, counter: OpCounter):
    """SGLang's own DFlashWorkerV2 over the same stand-ins, its in-graph draft sampler (built
    where the draft graphs are) as the buffer the graph leaves its tokens in."""
    from ddtree_sglang.sglang_plugin import sglang_api as sg

    worker = stand_in_worker(sg.DFlashWorkerV2, bs_max, counter)
    worker._draft_sampler = SimpleNamespace(out=torch.zeros(bs_max * (BLOCK - 1),
                                                            dtype=torch.long))
    return worker


def make_batch(worker, bs: int) -> SimpleNamespace:
    """A running decode batch of `bs` greedy requests without penalties, as the worker's step
    receives it (its relay state the worker's own kind)."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo

    seq = torch.full((bs,), SEQ_LEN, dtype=torch.int64)
    req = SimpleNamespace(sampling_params=SimpleNamespace(
        frequency_penalty=0.0, presence_penalty=0.0, repetition_penalty=1.0, min_new_tokens=0,
        stop_token_ids=None, sampling_seed=None, logit_bias=None))
    greedy = SamplingBatchInfo(
        temperatures=torch.ones(bs, 1), top_ps=torch.ones(bs),
        top_ks=torch.ones(bs, dtype=torch.int32), min_ps=torch.zeros(bs), is_all_greedy=True,
        is_any_greedy=True, need_top_p_sampling=False, need_top_k_sampling=False,
        need_min_p_sampling=False, vocab_size=VOCAB, device="cpu")
    return SimpleNamespace(
        forward_mode=ForwardMode.DECODE, is_extend_in_batch=False, return_logprob=False,
        seq_lens=seq, seq_lens_cpu=seq.clone(), seq_lens_sum=int(seq.sum()),
        spec_info=worker._make_next_draft_input_decode(
            bonus_tokens=torch.zeros(bs, dtype=torch.int64), new_seq_lens=seq),
        has_grammar=False, reqs=[req] * bs, sampling_info=greedy,
        req_pool_indices=torch.arange(bs), top_logprobs_nums=None, token_ids_logprobs=None,
        out_cache_loc=None, input_ids=None, device="cpu")


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


@dataclass
class Rig:
    """A worker over stand-ins, the op counter its stand-ins report to, and its DDTREE step
    (None for DFLASH), whose clock marks the stages."""

    worker: Any
    counter: OpCounter
    step: Any = None

    def run(self, bs: int) -> None:
        self.worker.forward_batch_generation(make_batch(self.worker, bs))


def count_calls(rig: Rig, bs: int, window: int, top: int = 20) -> dict:
    """Python and builtin calls per step over `window` steps: totals (and the range of the
    Python calls over the steps), by module, the top functions."""
    calls = CallCounter()
    for _ in range(window):
        calls.run(rig.worker.forward_batch_generation, make_batch(rig.worker, bs))

    def function(filename: str, name: str) -> str:
        return f"{module_of(filename)}:{name}"

    return dict(
        py_calls=calls.calls.total() / window,
        py_calls_range=[min(calls.per_step), max(calls.per_step)],
        c_calls=calls.c_calls.total() / window,
        py_by_module=per_step(calls.calls, window, lambda f, _: module_of(f)),
        c_by_module=per_step(calls.c_calls, window, lambda f, _: module_of(f)),
        top_functions=list(per_step(calls.calls, window, function).items())[:top],
        top_c_calls=list(per_step(calls.c_calls, window, function).items())[:top])


def count_ops(rig: Rig, bs: int, window: int) -> dict:
    """aten ops (views among them) and stood-in launches per step over `window` steps, by op,
    and DDTREE's ops by stage (the last step's)."""
    from ddtree_sglang.sglang_plugin.host_timing import NoClock

    counter, clock = rig.counter, StageTimes(rig.counter)
    if rig.step is not None:
        rig.step.clock = clock
    counter.reset()
    for _ in range(window):
        batch = make_batch(rig.worker, bs)
        with counter:
            rig.worker.forward_batch_generation(batch)
    out = dict(aten_ops=counter.count / window, views=counter.views / window,
               stood_in_ops=counter.stood_in / window,
               ops_by_name={k: v / window for k, v in counter.by_op.most_common()})
    if rig.step is not None:
        out["stage_ops"] = clock.ops[-1]
        rig.step.clock = NoClock()  # as the worker builds it
    return out


def time_steps(rig: Rig, bs: int, steps: int, warmup: int) -> dict:
    """Median host µs per step (and per DDTREE stage) over `steps` steps: noisy on a shared
    CPU, never asserted."""
    clock = StageTimes(rig.counter)
    if rig.step is not None:
        rig.step.clock = clock
    totals = []
    for i in range(warmup + steps):
        batch = make_batch(rig.worker, bs)
        started = time.perf_counter()
        rig.worker.forward_batch_generation(batch)
        if i >= warmup:
            totals.append((time.perf_counter() - started) * 1e6)
    out = dict(host_us=round(statistics.median(totals), 1))
    if rig.step is not None:
        timed = clock.steps[warmup:]
        out["stages_us"] = {k: round(statistics.median(s[k] for s in timed), 1)
                            for k in timed[0]}
    return out


def measure_rig(make: Callable[[OpCounter], Rig], bs: int, steps: int, warmup: int,
                window: int, settle: int) -> dict:
    """A fresh rig run `settle` steps, then its calls and its ops counted over `window` steps
    each (a multiple of the budget's cadences: every window holds the same steps), then
    timed over `steps` (after `warmup`; 0: not timed)."""
    torch.manual_seed(0)
    counter = OpCounter()
    rig = make(counter)
    with sglang_stand_ins(counter), torch.inference_mode():
        for _ in range(settle):
            rig.run(bs)
        out = dict(bs=bs, window=window, settle=settle, **count_calls(rig, bs, window),
                   **count_ops(rig, bs, window))
        if steps:
            out.update(time_steps(rig, bs, steps, warmup))
    return out


def measure(bs: int, budget: int, budgets: tuple[int, ...], steps: int = 200,
            warmup: int = 20, window: int = 32, settle: int = 128) -> dict:
    """DDTREE's decode step of a batch of `bs` at budget B (`budgets`: the batch-aware
    candidates, or (B,) pinned): see measure_rig."""
    def make(counter: OpCounter) -> Rig:
        worker = build_ddtree(max(bs, 1), budget, budgets, counter)
        return Rig(worker, counter, worker.ddtree_step)

    return dict(measure_rig(make, bs, steps, warmup, window, settle), budget=budget,
                budgets=list(budgets))


def measure_dflash(bs: int, steps: int = 200, warmup: int = 20, window: int = 32,
                   settle: int = 128) -> dict:
    """SGLang's DFLASH decode step of a batch of `bs` (the same draft block), the same way."""
    return measure_rig(lambda counter: Rig(build_dflash(max(bs, 1), counter), counter), bs,
                       steps, warmup, window, settle)


def measure_variant(variant: str, bs: int, **kwargs) -> dict:
    """One of VARIANTS at batch `bs` (kwargs: measure_rig's), named."""
    if variant == DFLASH:
        row = measure_dflash(bs, **kwargs)
    else:
        budgets = DDTREE[variant]
        row = measure(bs, max(budgets), budgets, **kwargs)
    return dict(row, variant=variant)
