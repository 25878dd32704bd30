"""Drive a server through the OpenAI endpoint (/v1/completions) or SGLang's native /generate:
streamed requests, a fixed number in flight per replica.

Each request records TTFT (first streamed token), TPOT ((end - first token) / (tokens - 1)),
its output ids and, through /generate, the server's per-request accept length and verify count.
 Requests are spread round-robin
over the replicas; `concurrency` is per replica.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable


@dataclass
class RequestResult:
    replica: int
    prompt_index: int
    output_ids: list[int] = field(default_factory=list)
    ttft: float = 0.0
    latency: float = 0.0
    accept_length: float | None = None
    verify_ct: int | None = None
    error: str | None = None
    sent_at: float = 0.0  # perf_counter when the request was sent (sustained load)

    @property
    def tpot(self) -> float | None:
        n = len(self.output_ids)
        return (self.latency - self.ttft) / (n - 1) if n > 1 else None


def _post_stream(url: str, body: dict, timeout: float):
    """POST a streaming request; yields each server-sent JSON chunk until [DONE]."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                return
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(str(chunk["error"])[:500])
            yield chunk


def stream_generate(url: str, input_ids: list[int], params: dict, timeout: float = 600.0):
    """SGLang's native POST /generate, streamed; returns (output_ids, ttft, latency, meta_info)
    with the per-request accept length and verify count in meta_info."""
    body = {"input_ids": input_ids, "sampling_params": params, "stream": True}
    t0 = time.perf_counter()
    ttft, last = None, {}
    for chunk in _post_stream(url + "/generate", body, timeout):
        if ttft is None and chunk.get("output_ids"):
            ttft = time.perf_counter() - t0
        last = chunk
    latency = time.perf_counter() - t0
    return last.get("output_ids", []), ttft or latency, latency, last.get("meta_info", {})


def stream_completion(url: str, input_ids: list[int], params: dict, timeout: float = 600.0):
    """The OpenAI endpoint POST /v1/completions, streamed, with the prompt and the output as
    token ids (SGLang's `return_token_ids`); returns (output_ids, ttft, latency, {})."""
    body = {"model": "default", "prompt": input_ids, "stream": True, "return_token_ids": True,
            "max_tokens": params["max_new_tokens"],
            **{k: v for k, v in params.items() if k != "max_new_tokens"}}
    t0 = time.perf_counter()
    ttft, ids = None, []
    for chunk in _post_stream(url + "/v1/completions", body, timeout):
        for choice in chunk.get("choices") or []:
            new = choice.get("token_ids") or []
            if new and ttft is None:
                ttft = time.perf_counter() - t0
            ids.extend(new)
    latency = time.perf_counter() - t0
    return ids, ttft or latency, latency, {}


ENDPOINTS = {"openai": stream_completion, "native": stream_generate}


def server_accept_length(url: str) -> float | None:
    """The server's running mean accept length since it started (GET /v1/loads); the OpenAI
    endpoint does not report it per request."""
    try:
        with urllib.request.urlopen(url + "/v1/loads?include=spec", timeout=30) as r:
            loads = json.loads(r.read()).get("loads") or []
    except (OSError, ValueError):
        return None
    vals = [ld["speculative"]["accept_length"] for ld in loads if ld.get("speculative")]
    return round(sum(vals) / len(vals), 3) if vals else None


def _send_one(send, urls: list[str], prompts: list[list[int]], params: dict,
              res: RequestResult, progress) -> RequestResult:
    """Send `res`'s request to its replica and record the outcome in it (an error too)."""
    try:
        ids, ttft, lat, meta = send(urls[res.replica], prompts[res.prompt_index], params)
        res.output_ids, res.ttft, res.latency = ids, ttft, lat
        res.accept_length = meta.get("spec_accept_length")
        res.verify_ct = meta.get("spec_verify_ct")
    except Exception as exc:  # noqa: BLE001 - recorded per request
        res.error = f"{type(exc).__name__}: {exc}"[:300]
    if progress is not None:
        progress.update(1)
    return res


def run_level(urls: list[str], prompts: list[list[int]], params: dict, concurrency: int,
              num_requests: int, progress=None, endpoint: str = "native"
              ) -> tuple[list[RequestResult], float]:
    """Send `num_requests` requests with `concurrency` in flight per replica through `endpoint`
    ("openai" or "native"); returns the results and the wall time."""
    send = ENDPOINTS[endpoint]
    jobs = [(i % len(urls), i % len(prompts)) for i in range(num_requests)]

    def one(job):
        replica, p = job
        return _send_one(send, urls, prompts, params,
                         RequestResult(replica=replica, prompt_index=p), progress)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency * len(urls)) as pool:
        results = list(pool.map(one, jobs))
    return results, time.perf_counter() - t0


def run_sustained(urls: list[str], prompts: list[list[int]], params: dict, concurrency: int,
                  done: Callable[[float, int], bool], progress=None, endpoint: str = "native"
                  ) -> tuple[list[RequestResult], float, float]:
    """Keep `concurrency` requests in flight per replica, each worker sending its next request
    as soon as its last one ends, until `done(seconds so far, requests sent)`; then let the
    last ones finish.  Unlike rounds of a fixed size, the load drains once per measurement,
    not once per round.  Returns the results, the wall time and when the last request was
    sent (seconds from the start; the drain begins there)."""
    send = ENDPOINTS[endpoint]
    lock = threading.Lock()
    sent = [0]
    last_sent = [0.0]
    t0 = time.perf_counter()

    def worker(_: int) -> list[RequestResult]:
        mine = []
        while True:
            with lock:
                if done(time.perf_counter() - t0, sent[0]):
                    return mine
                i = sent[0]
                sent[0] += 1
                last_sent[0] = time.perf_counter() - t0
            mine.append(_send_one(send, urls, prompts, params, RequestResult(
                replica=i % len(urls), prompt_index=i % len(prompts),
                sent_at=time.perf_counter() - t0), progress))

    workers = concurrency * len(urls)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        results = [r for rs in pool.map(worker, range(workers)) for r in rs]
    return results, time.perf_counter() - t0, last_sent[0]


def steady_tok_s(results: list[RequestResult], in_flight: int, drain_at: float) -> float | None:
    """Output tokens/s while the full load was in flight: from the moment every one of the
    first `in_flight` requests streams its first token to the moment the last request was
    sent (after which in-flight requests are no longer replaced).  A request's first token
    counts at its arrival and the rest evenly over its decode time (streamed tokens arrive at
    its TPOT).  None when that window is empty."""
    ok = sorted((r for r in results if r.error is None and r.output_ids),
                key=lambda r: r.sent_at)
    if len(ok) < in_flight:
        return None
    start = max(r.sent_at + r.ttft for r in ok[:in_flight])
    if drain_at <= start:
        return None
    tokens = 0.0
    for r in ok:
        first, end = r.sent_at + r.ttft, r.sent_at + r.latency
        tokens += start <= first <= drain_at
        n = len(r.output_ids) - 1
        if n > 0 and end > first:
            overlap = min(end, drain_at) - max(first, start)
            tokens += n * max(overlap, 0.0) / (end - first)
    return round(tokens / (drain_at - start), 1)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    k = (len(values) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def summarize(results: list[RequestResult], wall: float) -> dict:
    ok = [r for r in results if r.error is None]
    tokens = sum(len(r.output_ids) for r in ok)
    tpots = [r.tpot for r in ok if r.tpot is not None]
    acc = [(r.accept_length, len(r.output_ids)) for r in ok if r.accept_length]
    return dict(
        requests=len(results), errors=len(results) - len(ok), output_tokens=tokens,
        wall_s=round(wall, 3), output_tok_s=round(tokens / wall, 1) if wall > 0 else None,
        tpot_p50_ms=_ms(percentile(tpots, 0.5)), tpot_p90_ms=_ms(percentile(tpots, 0.9)),
        ttft_p50_ms=_ms(percentile([r.ttft for r in ok], 0.5)),
        accept_length=(round(sum(a * n for a, n in acc) / sum(n for _, n in acc), 3)
                       if acc else None),
        per_replica_tokens=_per_replica(ok),
        first_error=next((r.error for r in results if r.error), None),
    )


def _ms(x: float | None) -> float | None:
    return None if x is None else round(1000 * x, 2)


def _per_replica(ok: list[RequestResult]) -> dict[int, int]:
    out: dict[int, int] = {}
    for r in ok:
        out[r.replica] = out.get(r.replica, 0) + len(r.output_ids)
    return out
