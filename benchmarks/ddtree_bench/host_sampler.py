"""Where SGLang's scheduler process spends a decode step on the host, by Python function and by
stage: a pure-Python sampling profiler that the profile harness (profile.py) switches on
through SGLang's own /start_profile.

Why pure Python and in-process: the GPU machine installs nothing (a py-spy wheel does not fit
what a device call carries), and a thread of the scheduler process can read the scheduler's
stack with `sys._current_frames()`.  A daemon thread samples the scheduler's event-loop thread
about every `interval` s; while it samples, the interpreter's switch interval is lowered to
0.1 ms, so the sampled thread hands over the GIL within ~0.1 ms of a sample's request (at the
default 5 ms most samples would land where the thread releases the GIL by itself: its waits).
Its own cost is measured while it runs (`sampler_ms`, the time the sampling thread held the
GIL).  On a CPU (2 busy cores, 1 ms interval) a sample took 6-13 us, ~1% of the window; a
workload that releases the GIL every ~20 us as torch ops do ran 1-2% slower (median of 15
pairs), and its stages' sampled shares were within 0.5 points of their timed shares; code that
holds the GIL throughout pays a forced hand-off per sample (~5% slower there).

How it gets into the scheduler: benchmarks/pyproject.toml (and scripts/checkout_env.sh, for an
uninstalled checkout) declare `register` an entry point of SGLang's `sglang.srt.plugins` group,
which SGLang loads in every process.  It does nothing unless $DDTREE_BENCH_HOST_SAMPLES is set
and its caller is SGLang's scheduler process (`run_scheduler_process`); there it hooks the
scheduler's profiler (SchedulerProfilerManager, through SGLang's HookRegistry): a /start_profile
whose activities are [HOST_SAMPLES] (no torch activity: the torch profiler stays off) starts
the sampler, and SGLang's own step count stops it `num_steps` forward steps later, when
host-samples-TP-<rank>.json is written into the request's output_dir with the steps counted.

Stages come from the sampled stack: the part of the scheduler's event loop (the method the loop
called: run_batch, process_batch_result, ...) and, inside a speculative step, the stage: the
`stage_span` blocks of DDTREE's DecodeStep.run (the names its spec_stage_span spans carry in a
torch trace) and the numbered sections ("# --- 1) ...") of DFLASH's
DFlashWorkerV2.forward_batch_generation.
"""

from __future__ import annotations

import json
import linecache
import logging
import os
import random
import re
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

logger = logging.getLogger(__name__)

ENV = "DDTREE_BENCH_HOST_SAMPLES"  # set (to anything) in a server's environment: hooks on
ACTIVITY = "HOST_SAMPLES"  # the /start_profile activity that samples the host
FILE_GLOB = "host-samples-*.json"
PROFILER = "sglang.srt.managers.scheduler_components.profiler_manager.SchedulerProfilerManager"

# (file suffix, function name) of the functions whose source is split into stages
STAGED = frozenset({("ddtree_sglang/sglang_plugin/decode_step.py", "run"),
                    ("sglang/srt/speculative/dflash_worker_v2.py", "forward_batch_generation")})
# the scheduler's event loops: a sample's loop part is the method the loop called
LOOPS = frozenset({("sglang/srt/managers/scheduler.py", "event_loop_overlap"),
                   ("sglang/srt/managers/scheduler.py", "event_loop_normal")})
# frames between the loop and the method it called: decorators' wrappers, the overlap loop's
# local pop_and_process (which calls process_batch_result)
TRANSPARENT = frozenset({"wrapper", "decorate_context", "pop_and_process"})

SPAN = re.compile(r'^\s*with\b.*\bstage_span\("([^"]+)"\)')
SECTION = re.compile(r"^\s*#\s*---\s*(\d+\)\s*.*?)\.?\s*$")
_LOOP = "loop"  # a code's rule: one of the event loops


def short_path(filename: str) -> str:
    """A source file as the tables name it: SGLang's from below sglang/srt/, others from
    their package on (below site-packages, src/ or benchmarks/), else its last two parts."""
    path = filename.replace(os.sep, "/")
    for root in ("/sglang/srt/", "site-packages/", "dist-packages/", "/src/", "/benchmarks/"):
        if root in path:
            return path.rsplit(root, 1)[1]
    return "/".join(path.split("/")[-2:])


def function_name(code: CodeType) -> str:
    """`file:Class.method` (co_qualname from Python 3.11 on; co_name before)."""
    return f"{short_path(code.co_filename)}:{getattr(code, 'co_qualname', code.co_name)}"


def stage_lines(code: CodeType) -> dict[int, str]:
    """{line: stage} over a staged function's source: a `with ...stage_span("name"):` block
    is stage `name` to its end; a `# --- N) title` comment starts section `N) title`, which
    runs to the next one.  Lines in neither have no stage."""
    lines = linecache.getlines(code.co_filename)
    last = max((line for *_, line in code.co_lines() if line), default=code.co_firstlineno)
    stages: dict[int, str] = {}
    section = span = None
    span_indent = -1
    for n in range(code.co_firstlineno, min(last, len(lines)) + 1):
        text = lines[n - 1]
        indent = len(text) - len(text.lstrip())
        if span and text.strip() and indent <= span_indent:
            span = None
        if m := SECTION.match(text):
            section = m[1]
        if m := SPAN.match(text):
            span, span_indent = m[1], indent
        if span or section:
            stages[n] = span or section
    return stages


class HostSampler:
    """Samples one thread's Python stack every `interval` s from a daemon thread, counting per
    sample: the innermost function and line (self), every function inside the event loop once
    (cumulative), and the stage (see the module docstring; `staged` and `loops` name the
    functions that mark them)."""

    def __init__(self, thread_id: int, interval: float = 1e-3, switch_interval: float = 1e-4,
                 staged: frozenset = STAGED, loops: frozenset = LOOPS) -> None:
        self.thread_id, self.interval, self.switch_interval = thread_id, interval, switch_interval
        self.staged, self.loops = staged, loops
        self.samples, self.busy = 0, 0.0
        self.self_counts: Counter[tuple[str, int]] = Counter()
        self.cumulative: Counter[str] = Counter()
        self.stages: Counter[str] = Counter()
        self._codes: dict[CodeType, tuple[str, Any]] = {}  # code -> (name, rule)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="host-sampler", daemon=True)

    def start(self) -> "HostSampler":
        self._switch = sys.getswitchinterval()
        sys.setswitchinterval(self.switch_interval)
        self._t0 = time.perf_counter()
        self._thread.start()
        return self

    def stop(self) -> dict:
        """Stop sampling and return the record (the file's content, less `steps`)."""
        window = time.perf_counter() - self._t0
        self._stop.set()
        self._thread.join()
        sys.setswitchinterval(self._switch)
        by_fn: dict[str, Counter[int]] = {}
        for (name, line), n in self.self_counts.items():
            by_fn.setdefault(name, Counter())[line] += n
        own = sorted(((sum(c.values()), name, c.most_common(1)[0][0]) for name, c in by_fn.items()),
                     reverse=True)
        return dict(interval_ms=self.interval * 1e3, window_ms=round(window * 1e3, 3),
                    samples=self.samples, sampler_ms=round(self.busy * 1e3, 3),
                    stages=dict(self.stages.most_common()),
                    self={name: dict(samples=n, line=line) for n, name, line in own},
                    cumulative=dict(self.cumulative.most_common()))

    def _run(self) -> None:
        """Sample at times drawn on the clock alone (not from the last sample: a sample waits
        for the GIL, and timing from it would sample GIL-holding code less often), jittered
        against lock-step with a periodic workload; a sample late past later draws counts for
        each of them (the sampled thread held the GIL through them)."""
        frames, clock = sys._current_frames, time.perf_counter
        draw = random.Random(0).uniform
        due = clock() + self.interval * draw(0.5, 1.5)
        while not self._stop.wait(max(0.0, due - clock())):
            t0 = clock()
            weight = 0
            while due <= t0:
                due += self.interval * draw(0.5, 1.5)
                weight += 1
            if self._stop.is_set():  # the sampled thread is in stop(), past the window
                break
            frame = frames().get(self.thread_id)
            if frame is not None and weight:
                self._sample(frame, weight)
                self.samples += weight
            del frame
            self.busy += clock() - t0

    def _code(self, code: CodeType) -> tuple[str, Any]:
        """(name, rule) of a code object, worked out once: rule _LOOP, a staged function's
        {line: stage}, or None."""
        known = self._codes.get(code)
        if known is None:
            path, fn = code.co_filename.replace(os.sep, "/"), code.co_name
            rule = (_LOOP if any(path.endswith(s) and fn == f for s, f in self.loops)
                    else stage_lines(code) if any(path.endswith(s) and fn == f
                                                  for s, f in self.staged)
                    else None)
            known = self._codes[code] = (function_name(code), rule)
        return known

    def _sample(self, leaf: FrameType, weight: int) -> None:
        """Count one stack `weight` times, walking from the innermost frame out; cumulative
        counts stop at the event loop (what holds it, on every stack, would tell nothing) and
        skip the transparent wrappers."""
        names: set[str] = set()
        labels: list[str] = []
        callee = None  # the nearest non-transparent function inside the current frame
        in_loop = True
        frame: FrameType | None = leaf
        while frame is not None:
            code = frame.f_code
            name, rule = self._code(code)
            if rule is _LOOP:
                labels.append(callee.co_name if callee is not None else "event loop")
                in_loop = False
            elif rule is not None:
                labels.append(rule.get(frame.f_lineno) or f"{code.co_name} (outside its stages)")
            if code.co_name not in TRANSPARENT:
                callee = code
                if in_loop:
                    names.add(name)
            frame = frame.f_back
        self.self_counts[(self._code(leaf.f_code)[0], leaf.f_lineno)] += weight
        for name in names:
            self.cumulative[name] += weight
        self.stages[" > ".join(reversed(labels)) or "outside the event loop"] += weight


class _Window:
    """One sampled window of the scheduler's forward steps: opened by the profiler's start,
    closed by its stop (SGLang calls it from run_batch of the first step after the window,
    whose forward count is already taken: the window ran `count - 1 - start` steps)."""

    def __init__(self, manager: Any) -> None:
        self.start_ct = manager.get_forward_ct()
        self.path = (Path(manager.torch_profiler_output_dir)
                     / f"host-samples-TP-{manager.ps.tp_rank}.json")
        self.sampler = HostSampler(threading.get_ident()).start()

    def close(self, manager: Any) -> None:
        record = dict(self.sampler.stop(), steps=manager.get_forward_ct() - 1 - self.start_ct)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".json.tmp")  # the harness never reads a partial file
        tmp.write_text(json.dumps(record))
        os.replace(tmp, self.path)


_window: _Window | None = None


def _start_hook(original, manager, *args, **kwargs):
    """Around SchedulerProfilerManager._start_profile: a start whose activities name
    ACTIVITY opens the window (never fails the scheduler: a benchmark aid)."""
    global _window
    result = original(manager, *args, **kwargs)
    try:
        if _window is None and ACTIVITY in (getattr(manager, "profiler_activities", None) or ()):
            _window = _Window(manager)
    except Exception:  # noqa: BLE001 - logged; the server goes on
        logger.exception("host sampler: window not opened")
    return result


def _stop_hook(original, manager, *args, **kwargs):
    """Around SchedulerProfilerManager._stop_profile: closes an open window and writes its
    samples file (SGLang calls the stop on every step after a profile's last: cheap then)."""
    global _window
    if _window is not None:
        window, _window = _window, None
        try:
            window.close(manager)
        except Exception:  # noqa: BLE001 - logged; the server goes on
            logger.exception("host sampler: samples not written")
    return original(manager, *args, **kwargs)


def in_scheduler_process() -> bool:
    """Whether SGLang's run_scheduler_process is on the caller's stack (it loads the plugins
    first thing, before the process gets its title)."""
    frame = sys._getframe(1)
    while frame is not None:
        if (frame.f_code.co_name == "run_scheduler_process"
                and frame.f_globals.get("__name__") == "sglang.srt.managers.scheduler"):
            return True
        frame = frame.f_back
    return False


def register() -> None:
    """Entry point (group sglang.srt.plugins): nothing unless $DDTREE_BENCH_HOST_SAMPLES is set
    in a scheduler process; there, the profiler hooks that sample the host."""
    if not os.environ.get(ENV) or not in_scheduler_process():
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(f"{PROFILER}._start_profile", _start_hook, HookType.AROUND)
    HookRegistry.register(f"{PROFILER}._stop_profile", _stop_hook, HookType.AROUND)
    logger.info("host sampler: a /start_profile with activities [%s] samples this scheduler",
                ACTIVITY)
