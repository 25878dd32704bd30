"""Per-step GPU profile of a live server: SGLang's own torch-profiler hook (`/start_profile`)
records a fixed number of decode steps under steady load; the Chrome trace it writes is reduced
here to a kernel-time table (by kernel name and by stage) and the GPU idle time between kernels.

Why a live server and not a micro-benchmark: the question is what a DDTREE step costs beside a
DFLASH step with everything SGLang does around it (CUDA graphs, overlap scheduling, the verify
attention path), and the gaps where the GPU waits for the host are only visible there.

Two recordings per cell: GPU activity only, for the timings (span, busy, idle, kernels), and
with the host's activity too (`["CPU", "GPU"]`), whose CUDA runtime and driver calls give the
launches per step (`launch_counts`); the host's recording slows the step, so the second
recording's timings are not used.  With host samples a third recording, without the torch
profiler, samples the scheduler's Python stack (host_sampler.py): where the host's time goes
per step, by function and by stage (`host_table`).
"""

from __future__ import annotations

import gzip
import json
import re
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

from ddtree_bench import host_sampler

# (pattern on the kernel name, stage) - first match wins; what is left is "other".
STAGES: list[tuple[str, str]] = [
    (r"memcpy|memset|Memcpy|Memset", "copies"),
    # before "attention": FlashInfer's fused add + RMSNorm is named flashinfer::norm::...
    (r"RMSNorm|rms_norm|rmsnorm|qknorm", "norms"),
    # DDTREE's tree-attention kernel (kernels/tree_attention.py) is the verify's attention
    (r"_fwd_kernel|extend_attention|attention|flash|fmha|decode_.*kv|_splitkv|_prefix_kernel"
     r"|_tree_merge_kernel", "attention"),
    (r"nvjet|gemm|Gemm|cutlass|sm90_xmma|sm80_xmma|ampere_|hopper_|matmul|splitKreduce", "gemm"),
    (r"_tree_kernel|_score_key", "tree (fused kernel)"),
    (r"sort|Sort|topk|TopK|radix|bitonic|gatherTopK", "sort / top-k"),
    (r"softmax|logsumexp|LogSoftMax|SoftMax|reduce_kernel|Reduce", "softmax / reductions"),
    (r"rms|norm|Norm", "norms"),
    (r"silu|act_and_mul|gelu", "activations"),
    (r"rotary|rope", "rotary"),
    (r"index|gather|scatter|Index|Gather|Scatter|cat|Cat", "index / gather / scatter"),
    (r"elementwise|vectorized|unrolled|Elementwise|fill|Fill", "elementwise"),
]


def stage_of(name: str) -> str:
    for pattern, stage in STAGES:
        if re.search(pattern, name):
            return stage
    return "other"


def start_profile(url: str, out_dir: Path, steps: int, activities: list[str] = ("GPU",)) -> None:
    """Ask the server to profile its next `steps` forward steps, recording `activities` ("GPU":
    kernels and copies; "CPU" adds the host's ops and its CUDA runtime calls), without call
    stacks or shapes (they only make the trace larger)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    body = {"output_dir": str(out_dir.resolve()), "num_steps": steps,
            "activities": list(activities), "with_stack": False, "record_shapes": False}
    req = urllib.request.Request(url + "/start_profile", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        resp.read()


def _stream_one(url: str, input_ids: list[int], params: dict, first: threading.Event) -> int:
    """One streamed /generate request; sets `first` at its first output chunk (its prefill is
    done).  Returns the number of chunks."""
    from ddtree_bench.client import _post_stream

    body = {"input_ids": input_ids, "sampling_params": params, "stream": True}
    n = 0
    try:
        for _ in _post_stream(url + "/generate", body, timeout=600.0):
            n += 1
            first.set()
    finally:
        first.set()  # ended or failed without output: nothing to wait for
    return n


def read_trace(path: Path) -> list[dict]:
    with gzip.open(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def read_samples(path: Path) -> dict:
    """A host samples file (host_sampler.py; written whole, by a rename)."""
    return json.loads(path.read_text())


def profile_under_load(url: str, prompts: list[list[int]], params: dict, bs: int,
                       trace_dir: Path, steps: int, activities: list[str],
                       first_timeout: float = 120.0, pattern: str = "*.trace.json.gz",
                       read: Callable[[Path], Any] = read_trace) -> Any:
    """Keep `bs` streamed requests in flight, start the profile of `steps` forward steps once
    every one of them has streamed its first token (all past prefill: the profiled steps are
    decode steps of the full batch), and return the file the server writes (`pattern`, read
    with `read`: by default the events of its trace).  The requests must outlive the profiled
    steps (params' max_new_tokens)."""
    firsts = [threading.Event() for _ in range(bs)]
    with ThreadPoolExecutor(bs) as pool:
        load = [pool.submit(_stream_one, url, prompts[i % len(prompts)], params, firsts[i])
                for i in range(bs)]
        deadline = time.time() + first_timeout
        for ev in firsts:
            ev.wait(max(0.0, deadline - time.time()))
        if not all(ev.is_set() for ev in firsts):
            raise TimeoutError(f"{sum(not e.is_set() for e in firsts)} of {bs} requests had no "
                               f"first token after {first_timeout:.0f} s")
        failed = next((f.exception() for f in load if f.done() and f.exception()), None)
        if failed is not None:  # a request that failed is the profile's error
            raise failed
        start_profile(url, trace_dir, steps, activities)
        found = wait_for_trace(trace_dir, given_up=lambda: all(f.done() for f in load),
                               pattern=pattern, read=read)
        for f in load:
            f.result()  # a request that failed is the profile's error too
    return found


def wait_for_trace(out_dir: Path, timeout: float = 120.0,
                   given_up: Callable[[], bool] = lambda: False, grace: float = 15.0,
                   poll: float = 0.2, pattern: str = "*.trace.json.gz",
                   read: Callable[[Path], Any] = read_trace) -> Any:
    """The file the server writes once its profiled steps are done (`pattern`; by default the
    events of its trace), read once whole (a gzip still being written does not parse).
    `given_up()` true (the load ended) and still no file after `grace` s: the profiled steps
    never came."""
    deadline = time.time() + timeout
    ended_at = None
    while time.time() < deadline:
        found = sorted(out_dir.glob(pattern))
        if found:
            try:
                return read(found[0])
            except (EOFError, OSError, ValueError):  # still being written
                pass
        elif ended_at is None and given_up():
            ended_at = time.time()
        elif ended_at is not None and time.time() - ended_at > grace:
            raise RuntimeError(f"the load ended before the profiled steps did (no {pattern} in "
                               f"{out_dir}): raise profile.new_tokens")
        time.sleep(poll)
    raise TimeoutError(f"no whole {pattern} in {out_dir} after {timeout:.0f} s")


def _busy_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals."""
    busy, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if s > end:
            busy += e - s
            end = e
        elif e > end:
            busy += e - end
            end = e
    return busy


def kernel_table(events: list[dict], steps: int, top: int = 25) -> dict:
    """Reduce trace events to per-step figures: kernel time by name and by stage, the span from
    the first kernel to the last, and the GPU idle time inside that span."""
    kernels = [e for e in events if e.get("ph") == "X" and
               e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]
    if not kernels:
        raise ValueError("the trace holds no GPU kernels (was the GPU activity recorded?)")
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e["name"], []).append(float(e["dur"]))
    start = min(float(e["ts"]) for e in kernels)
    end = max(float(e["ts"]) + float(e["dur"]) for e in kernels)
    busy = _busy_us([(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in kernels])
    rows = sorted(((sum(d), len(d), n) for n, d in by_name.items()), reverse=True)
    stages: dict[str, float] = {}
    for total, _, name in rows:
        stage = stage_of(name)
        stages[stage] = stages.get(stage, 0.0) + total
    per = 1e-3 / steps  # us over the window -> ms per step
    return dict(
        host_waits=host_waits(events, steps),
        steps=steps, span_ms=round((end - start) * per, 4), busy_ms=round(busy * per, 4),
        idle_ms=round((end - start - busy) * per, 4),
        stages={k: round(v * per, 4) for k, v in sorted(stages.items(), key=lambda kv: -kv[1])},
        kernels=[dict(name=name[:120], stage=stage_of(name), calls=round(calls / steps, 2),
                      ms=round(total * per, 4)) for total, calls, name in rows[:top]])


# The host's calls that put work on the GPU, by kind: a kernel launched outside a CUDA graph
# (runtime or driver API: Triton launches through the driver), a graph replay, a copy, a set.
LAUNCHES = {"eager": ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel",
                      "cuLaunchKernelEx"),
            "graph": ("cudaGraphLaunch", "cuGraphLaunch"),
            "memcpy": ("cudaMemcpyAsync", "cuMemcpyAsync", "cuMemcpyHtoDAsync_v2",
                       "cuMemcpyDtoHAsync_v2"),
            "memset": ("cudaMemsetAsync", "cuMemsetD8Async", "cuMemsetD32Async")}
HOST_CALLS = ("cuda_runtime", "cuda_driver")  # trace categories of the host's CUDA API calls


def launch_counts(events: list[dict], steps: int) -> dict:
    """Per step: kernels launched outside CUDA graphs (`eager`), graph replays (`graph`),
    async copies and sets, from the host's CUDA runtime and driver calls in the trace (they are
    recorded with the host's activity only: `recorded` is False without any), and the count per
    call name."""
    calls = [e for e in events if e.get("ph") == "X" and e.get("cat") in HOST_CALLS]
    by_name: dict[str, int] = {}
    for e in calls:
        by_name[e.get("name", "")] = by_name.get(e.get("name", ""), 0) + 1
    per = {kind: round(sum(by_name.get(n, 0) for n in names) / steps, 2)
           for kind, names in LAUNCHES.items()}
    return dict(recorded=bool(calls), **per, steps=steps,
                calls={n: round(c / steps, 2) for n, c in sorted(by_name.items())})


# CUDA runtime calls that make the host wait for the GPU (or, for a pageable host->device copy,
# for the copy): inside a decode step each one can leave the GPU idle while the host catches up.
HOST_WAITS = r"^(cudaStreamSynchronize|cudaDeviceSynchronize|cudaEventSynchronize|cudaMemcpy)$"


def host_waits(events: list[dict], steps: int) -> dict:
    """Per step: the CUDA runtime calls that block the host on the GPU (HOST_WAITS: calls and
    ms by name) and the host<->device copies through pageable memory (calls; such a copy to
    the device is synchronous for the host).  From the same trace as `kernel_table`."""
    waits: dict[str, list[float]] = {}
    runtime = [e for e in events if e.get("ph") == "X" and e.get("cat") == "cuda_runtime"]
    for e in runtime:
        if re.search(HOST_WAITS, e.get("name", "")):
            waits.setdefault(e["name"], []).append(float(e.get("dur", 0.0)))
    pageable = sum(1 for e in events if e.get("ph") == "X" and e.get("cat") == "gpu_memcpy"
                   and "Pageable" in e.get("name", ""))
    return dict(
        recorded=bool(runtime),  # no runtime calls in the trace at all: nothing can be said
        calls={n: dict(calls=round(len(d) / steps, 2), ms=round(sum(d) * 1e-3 / steps, 4))
               for n, d in sorted(waits.items())},
        pageable_copies=round(pageable / steps, 2))


def host_profile(url: str, prompts: list[list[int]], params: dict, bs: int, out_dir: Path,
                 steps: int) -> dict:
    """`host_table` of `steps` decode steps sampled in the server's scheduler: a /start_profile
    with activities [HOST_SAMPLES] and no torch activity (host_sampler.py), so the torch
    profiler stays off and the steps run as they do unobserved, but for the sampler."""
    try:
        samples = profile_under_load(url, prompts, params, bs, out_dir, steps,
                                     [host_sampler.ACTIVITY], pattern=host_sampler.FILE_GLOB,
                                     read=read_samples)
    except (RuntimeError, TimeoutError) as exc:
        raise type(exc)(f"{exc}; or the server samples no host: it needs "
                        f"{host_sampler.ENV}=1 and the bench's sglang.srt.plugins entry point "
                        "(pip install -e benchmarks, or source scripts/checkout_env.sh)") from None
    return host_table(samples)


def host_table(samples: dict, top: int = 40) -> dict:
    """Reduce a host samples file to ms per decode step: the step's wall time under sampling
    (the window / its steps), the sampler's own time, and each stage's and the `top`
    functions' share of the window (self: innermost, with its hottest line; cumulative: the
    function and what it calls).  A stage's or function's ms = its share of the samples x the
    window / steps, so the stages add up to the step."""
    steps, n = samples["steps"], samples["samples"]
    if steps < 1 or n < 1:
        raise ValueError(f"host samples: {n} samples over {steps} steps")
    per = samples["window_ms"] / n / steps  # ms per step that one sample stands for
    stages = sorted(samples["stages"].items(), key=lambda kv: -kv[1])
    own = sorted(samples["self"].items(), key=lambda kv: -kv[1]["samples"])[:top]
    cumulative = sorted(samples["cumulative"].items(), key=lambda kv: -kv[1])[:top]
    return dict(
        steps=steps, step_ms=round(samples["window_ms"] / steps, 4),
        sampler_ms=round(samples["sampler_ms"] / steps, 4), samples_per_step=round(n / steps, 1),
        stages={k: round(c * per, 4) for k, c in stages},
        self=[dict(function=f, line=v["line"], ms=round(v["samples"] * per, 4)) for f, v in own],
        cumulative=[dict(function=f, ms=round(c * per, 4)) for f, c in cumulative])


HOST_NOTE = (
    "Sampled in the scheduler process by ddtree_bench/host_sampler.py: a thread reads the event "
    "loop's Python stack about every 1 ms over `host_steps` decode steps, in a recording of its "
    "own (no torch profiler).  ms per step = share of the samples x the window / its steps; the "
    "stages add up to the step.  Stage: the event loop's call (run_batch, process_batch_result, "
    "...) > the speculative stage (DDTREE: the stage_span blocks of DecodeStep.run; DFLASH: the "
    "numbered sections of DFlashWorkerV2.forward_batch_generation).  Self: the innermost Python "
    "function, its hottest line after the colon (time in the C calls it makes, torch ops and "
    "waits on the GPU included, is its own); cumulative: the function and what it calls, "
    "inside the event loop.")


def _table(head: str, cells: list[str], rows: dict[str, dict[str, str]]) -> list[str]:
    """A markdown table: one row per key of `rows`, one column per cell ("-" where absent)."""
    lines = [f"| {head} | " + " | ".join(cells) + " |", "|---" * (len(cells) + 1) + "|"]
    return lines + [f"| {k} | " + " | ".join(v.get(c, "-") for c in cells) + " |"
                    for k, v in rows.items()]


def host_markdown(profiles: dict[str, dict], top: int = 12) -> list[str]:
    """Per batch, the cells with host samples side by side (DFLASH beside DDTREE): ms per step
    by stage, then the union of each cell's `top` functions by self and by cumulative time."""
    by_batch: dict[str, list[str]] = {}
    for c in profiles:
        if profiles[c].get("host"):
            by_batch.setdefault(c.rsplit("@", 1)[-1], []).append(c)
    failed = [f"- {c}: no host samples: {p['host_error']}" for c, p in profiles.items()
              if p.get("host_error")]
    if not by_batch and not failed:
        return []
    lines = ["", "## host: where the scheduler's time goes per decode step", "", HOST_NOTE]
    if failed:
        lines += ["", *failed]
    for bs, cells in by_batch.items():
        hosts = {c: profiles[c]["host"] for c in cells}
        head = {"**step (wall, under sampling)**": {c: str(h["step_ms"]) for c, h in hosts.items()},
                "sampler's own time": {c: str(h["sampler_ms"]) for c, h in hosts.items()},
                "samples per step": {c: str(h["samples_per_step"]) for c, h in hosts.items()}}
        lines += ["", f"### batch {bs}: ms per decode step by stage", ""]
        lines += _table("stage", cells, head | _ranked_rows(
            {c: [(k, ms, str(ms)) for k, ms in h["stages"].items()] for c, h in hosts.items()}))
        for kind, label in (("self", "self time"), ("cumulative", "cumulative time")):
            lines += ["", f"### batch {bs}: top functions by {label}, ms per step", ""]
            lines += _table("function", cells, _ranked_rows(
                {c: [(f"`{r['function']}`", r["ms"], _ms_at_line(r)) for r in h[kind][:top]]
                 for c, h in hosts.items()}))
    return lines


def _ms_at_line(row: dict) -> str:
    """A function's ms per step, with its hottest line where the row has one (self time)."""
    return f"{row['ms']} (:{row['line']})" if "line" in row else str(row["ms"])


def _ranked_rows(per_cell: dict[str, list[tuple[str, float, str]]]) -> dict[str, dict[str, str]]:
    """{row: {cell: text}} from each cell's (row, ms, text), rows by their largest ms."""
    rows: dict[str, dict[str, str]] = {}
    peak: dict[str, float] = {}
    for c, entries in per_cell.items():
        for key, ms, text in entries:
            rows.setdefault(key, {})[c] = text
            peak[key] = max(peak.get(key, 0.0), ms)
    return {k: rows[k] for k in sorted(rows, key=lambda k: -peak[k])}


def markdown(profiles: dict[str, dict], title: str) -> str:
    """One stage table (arm@batch columns) and each cell's top kernels."""
    cells = list(profiles)
    stages = list(dict.fromkeys(s for p in profiles.values() for s in p["stages"]))
    lines = [title, "", "Per decode step, ms (the profiled window / its steps).", "",
             "| | " + " | ".join(cells) + " |", "|---" * (len(cells) + 1) + "|"]
    for key, label in [("span_ms", "**step span (first kernel to last)**"),
                       ("busy_ms", "GPU busy"), ("idle_ms", "**GPU idle inside the span**")]:
        lines.append(f"| {label} | " + " | ".join(str(profiles[c][key]) for c in cells) + " |")
    for s in stages:
        lines.append(f"| {s} | " + " | ".join(str(profiles[c]["stages"].get(s, 0.0))
                                             for c in cells) + " |")

    def waits(c: str) -> str:
        w = profiles[c].get("host_waits")
        if w is None:
            return "-"
        calls = ", ".join(f"{n} {v['calls']} ({v['ms']} ms)" for n, v in w["calls"].items())
        if not w.get("recorded", True):
            calls = "runtime calls not in the trace"
        return f"{calls or 'none'}; pageable copies {w['pageable_copies']}"
    lines.append("| host waits on the GPU (calls / step) | "
                 + " | ".join(waits(c) for c in cells) + " |")

    def launches(c: str, kind: str) -> str:
        la = profiles[c].get("launches")
        return "-" if not la or not la.get("recorded") else str(la[kind])
    for kind, label in (("eager", "**kernel launches outside CUDA graphs**"),
                        ("graph", "CUDA graph replays"), ("memcpy", "async copies"),
                        ("memset", "async sets")):
        lines.append(f"| {label} (per step) | " + " | ".join(launches(c, kind) for c in cells)
                     + " |")
    for c in cells:
        lines += ["", f"### {c}: top kernels", "", "| kernel | stage | calls / step | ms / step |",
                  "|---|---|---|---|"]
        lines += [f"| `{k['name']}` | {k['stage']} | {k['calls']} | {k['ms']} |"
                  for k in profiles[c]["kernels"]]
    return "\n".join(lines + host_markdown(profiles)) + "\n"
