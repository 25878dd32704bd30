"""DDTREE's exactness at the edges, in real SGLang servers on the GPU machine, in one call.

    source scripts/checkout_env.sh && python tests/gpu/reliability.py --out $OUT/rel

Five `sglang.launch_server` processes on the shipped testbed pair start together (triton,
float16, CUDA graphs, strict idle KV-leak checker): `ddtree` (B = 32), `plain` (no
speculation), `plain_sync` (no speculation, --disable-overlap-schedule: plain SGLang applies
penalties to every output token only without overlap; with overlap it lags one token) and
`ddtree_small` (B = 32 with a small KV pool, for retraction), `ddtree_eager` (graphs only up
to batch 8).  Phases, each compared with a
reference and written to reliability.json as it finishes:

  penalties     greedy, frequency / presence / repetition / mixed: DDTREE vs plain_sync,
                and every token re-scored by the target in float32 with the penalties
  min_new       prompts that really stop, min_new_tokens past the stop: vs plain_sync
  eos_boundary  EOS and stop strings with max_new_tokens around the stop point: vs plain
  distribution  T=1, top_k 20, top_p 0.8: the second token (DDTREE's first own draw) vs the
                target's filtered distribution (chi-square), DDTREE and plain
  context       prompts near --context-length decoding into it: lengths and tokens vs plain
  retraction    96 requests on the small pool: re-scored, penalties included
  aborts        256 streams dropped after 0-5 chunks, then requests still served
  shared_prefix 64 requests sharing a 380-token prefix: re-scored
  bad_inputs    out-of-vocab / negative ids, empty prompt, bad sampling values, over-long
                prompt, invalid JSON: status and message, server alive (plain beside it)
  eager         48 requests on a server with graphs only up to batch 8: re-scored
  final         greedy re-scored again, KV 0 after /flush_cache, no leak / traceback in logs
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from ddtree_bench.server import (Server, ServerSpec, get_json, post_json,  # noqa: E402
                                        stop_servers_on_sigterm)
from ddtree_sglang.sampling.penalties import RequestPenalties  # noqa: E402
from ddtree_sglang.reference.testbed import encode_prompt, read_prompts  # noqa: E402
from rescoring import pick_flat_prompt, second_token_fit, teacher_force  # noqa: E402

TIE = 0.05


def many(url: str, prompts, params, workers: int = 48) -> list[dict]:
    params = params if isinstance(params, list) else [params] * len(prompts)

    def one(i):
        return post_json(url + "/generate", {"input_ids": prompts[i], "sampling_params": params[i]})
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(one, range(len(prompts))))


def ids_of(results) -> list[list[int]]:
    return [r.get("output_ids") or [] for r in results]


def finish(r: dict) -> str | None:
    return ((r.get("meta_info") or {}).get("finish_reason") or {}).get("type")


def equal_count(a, b) -> int:
    return sum(x == y for x, y in zip(ids_of(a), ids_of(b)))


def errors(results) -> list[str]:
    return [json.dumps(r["error"])[:200] for r in results if "error" in r][:3]


# -- phases ------------------------------------------------------------------------------------
def phase_penalties(s, model, prompts48) -> dict:
    configs = {"none": RequestPenalties(), "frequency 1.5": RequestPenalties(frequency=1.5),
               "presence 1.5": RequestPenalties(presence=1.5),
               "repetition 1.8": RequestPenalties(repetition=1.8),
               "mixed 0.5/0.5/1.2": RequestPenalties(frequency=0.5, presence=0.5, repetition=1.2)}
    out = {}
    for name, pen in configs.items():
        params = dict(temperature=0, max_new_tokens=64, ignore_eos=True,
                      frequency_penalty=pen.frequency, presence_penalty=pen.presence,
                      repetition_penalty=pen.repetition)
        d, ref, lag = (many(s[a].url, prompts48, params) for a in ("ddtree", "plain_sync", "plain"))
        out[name] = dict(
            equal_to_plain_sync=f"{equal_count(d, ref)}/{len(d)}",
            equal_to_plain_overlap=f"{equal_count(d, lag)}/{len(d)}",
            ddtree_rescored=teacher_force(model, prompts48, ids_of(d), TIE, pen),
            plain_sync_rescored=teacher_force(model, prompts48, ids_of(ref), TIE, pen),
            errors=errors(d + ref))
    return out


def stopping_requests(s, prompts) -> list[tuple[list[int], dict, int]]:
    """Requests that really stop: the testbed target seldom emits EOS, so each prompt gets a
    stop token id taken from its own greedy continuation (a token first seen at output index
    k in 6..40).  Returns (prompt, params, stop length k + 1), plain_sync being the source."""
    res = many(s["plain_sync"].url, prompts, dict(temperature=0, max_new_tokens=64,
                                                  ignore_eos=True))
    out = []
    for p, r in zip(prompts, res):
        o = r.get("output_ids") or []
        k = next((k for k in range(6, min(41, len(o))) if o[k] not in o[:k]), None)
        if k is not None:
            out.append((p, dict(temperature=0, stop_token_ids=[o[k]]), k + 1))
    return out


def phase_min_new(s, stops) -> dict:
    rows = stops[:16]
    prompts = [p for p, _, _ in rows]
    params = [dict(sp, max_new_tokens=k + 40, min_new_tokens=k + 8) for _, sp, k in rows]
    d, ref = many(s["ddtree"].url, prompts, params), many(s["plain_sync"].url, prompts, params)
    early = sum(len(r.get("output_ids") or []) < p["min_new_tokens"]
                for r, p in zip(d, params))
    return dict(prompts=len(rows), equal_to_plain_sync=f"{equal_count(d, ref)}/{len(d)}",
                finish_equal=sum(finish(a) == finish(b) for a, b in zip(d, ref)),
                ddtree_finish_types=sorted({str(finish(a)) for a in d}),
                ddtree_shorter_than_min_new=early, errors=errors(d + ref))


def phase_eos_boundary(s, stops, tok) -> dict:
    eos_cases, stop_cases = [], []
    for p, sp, k in stops[:10]:
        for m in range(max(1, k - 3), k + 3):
            eos_cases.append((p, dict(sp, max_new_tokens=m)))
    # Stop strings: a piece of text from the middle of a longer greedy output.
    longer = many(s["plain"].url, [p for p, _, _ in stops[:10]],
                  dict(temperature=0, max_new_tokens=48, ignore_eos=True))
    for (p, _, _), r in zip(stops[:10], longer):
        o = r.get("output_ids") or []
        if len(o) < 24:
            continue
        k = 12
        text = tok.decode(o[k:k + 2]).strip()
        if len(text) < 2:
            continue
        for m in range(k - 2, k + 5):
            stop_cases.append((p, dict(temperature=0, max_new_tokens=m, ignore_eos=True,
                                       stop=[text])))
    out = {}
    for name, cases in (("stop_token", eos_cases), ("stop_string", stop_cases)):
        prompts, params = [c[0] for c in cases], [c[1] for c in cases]
        d, ref = many(s["ddtree"].url, prompts, params), many(s["plain"].url, prompts, params)
        same = sum(a.get("output_ids") == b.get("output_ids") and finish(a) == finish(b)
                   and a.get("text") == b.get("text") for a, b in zip(d, ref))
        out[name] = dict(cases=len(cases), output_and_finish_equal=same,
                         finish_types=sorted({str(finish(a)) for a in d}),
                         mismatches=[dict(max_new=p["max_new_tokens"], ddtree=finish(a),
                                          plain=finish(b), ddtree_len=len(a.get("output_ids") or []),
                                          plain_len=len(b.get("output_ids") or []))
                                     for p, a, b in zip(params, d, ref)
                                     if (a.get("output_ids"), finish(a)) !=
                                     (b.get("output_ids"), finish(b))][:5],
                         errors=errors(d + ref))
    return out


def phase_distribution(s, model, prompt, samples: int) -> dict:
    params = dict(temperature=1.0, top_k=20, top_p=0.8, max_new_tokens=2, ignore_eos=True)
    out = dict(prompt_len=len(prompt))
    for arm in ("ddtree", "plain"):
        res = many(s[arm].url, [prompt] * samples, params, workers=64)
        pairs = [tuple(r["output_ids"][:2]) for r in res if len(r.get("output_ids") or []) >= 2]
        out[arm] = dict(joint=second_token_fit(model, prompt, pairs, 1.0, 20, 0.8),
                        sequential=second_token_fit(model, prompt, pairs, 1.0, 20, 0.8, True),
                        errors=errors(res))
    return out


def phase_context(s, model, long_ids, context: int) -> dict:
    # No max_new_tokens (an explicit one past the context is refused with HTTP 400): SGLang's
    # default of 128 then runs into the context limit, where the scheduler stops the request.
    prompts = [long_ids[20 * i: 20 * i + context - 100 + 4 * i] for i in range(24)]
    params = dict(temperature=0, ignore_eos=True)
    d, ref = many(s["ddtree"].url, prompts, params), many(s["plain"].url, prompts, params)
    lens = [(len(a.get("output_ids") or []), len(b.get("output_ids") or [])) for a, b in zip(d, ref)]
    return dict(requests=len(prompts), prompt_lens=f"{len(prompts[0])}..{len(prompts[-1])}",
                lengths_equal=sum(a == b for a, b in lens), tokens_equal=equal_count(d, ref),
                ddtree_length_range=[min(x for x, _ in lens), max(x for x, _ in lens)],
                plain_length_range=[min(y for _, y in lens), max(y for _, y in lens)],
                ended_at_context=sum(len(p) + a >= context - 8 for (a, _), p in zip(lens, prompts)),
                finish_equal=sum(finish(a) == finish(b) for a, b in zip(d, ref)),
                # a differing request at ~2k tokens of context: a near-tie or a wrong token?
                ddtree_rescored=teacher_force(model, prompts, ids_of(d), TIE),
                plain_rescored=teacher_force(model, prompts, ids_of(ref), TIE),
                differing=[dict(request=i, prompt_len=len(p), ddtree=a, plain=b)
                           for i, (p, a, b) in enumerate(zip(prompts, ids_of(d), ids_of(ref)))
                           if a != b],
                errors=errors(d + ref))


def phase_retraction(s, model, prompts) -> dict:
    base = [prompts[i % len(prompts)] for i in range(96)]
    pen = RequestPenalties(frequency=1.0)
    params = [dict(temperature=0, max_new_tokens=128, ignore_eos=True,
                   frequency_penalty=1.0 if i % 6 == 0 else 0.0) for i in range(96)]
    res = many(s["ddtree_small"].url, base, params, workers=64)
    outs = ids_of(res)
    plain_idx = [i for i in range(96) if i % 6]
    pen_idx = [i for i in range(96) if i % 6 == 0]
    log = s["ddtree_small"].log_path.read_text(errors="ignore")
    return dict(requests=96, complete=sum(len(o) == 128 for o in outs),
                retract_lines_in_log=log.lower().count("retract"),
                rescored=teacher_force(model, [base[i] for i in plain_idx],
                                       [outs[i] for i in plain_idx], TIE),
                rescored_frequency_1=teacher_force(model, [base[i] for i in pen_idx],
                                                   [outs[i] for i in pen_idx], TIE, pen),
                errors=errors(res))


def phase_aborts(s, prompts, n: int = 256) -> dict:
    url = s["ddtree"].url + "/generate"

    def one(i):
        body = {"input_ids": prompts[i % len(prompts)], "stream": True,
                "sampling_params": {"temperature": 0 if i % 2 else 1.0, "max_new_tokens": 256,
                                    "ignore_eos": True}}
        req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            resp = urllib.request.urlopen(req, timeout=120)
            for k, _ in enumerate(resp):
                if k >= 2 * (i % 6):  # data line + blank line per chunk
                    break
            resp.close()
            return True
        except Exception:  # noqa: BLE001
            return False
    with ThreadPoolExecutor(64) as pool:
        opened = sum(pool.map(one, range(n)))
    time.sleep(3)
    after = many(s["ddtree"].url, prompts[:8], dict(temperature=0, max_new_tokens=32, ignore_eos=True))
    return dict(streams=n, opened=opened, served_after=sum(len(o) == 32 for o in ids_of(after)),
                alive=s["ddtree"].alive())


def phase_shared_prefix(s, model, long_ids, prompts) -> dict:
    prefix = long_ids[:380]
    reqs = [prefix + prompts[i % len(prompts)][: 5 + i % 25] for i in range(64)]
    res = many(s["ddtree"].url, reqs, dict(temperature=0, max_new_tokens=48, ignore_eos=True))
    return dict(requests=64, rescored=teacher_force(model, reqs, ids_of(res), TIE),
                errors=errors(res))


KILLS_PLAIN = ("token id = vocab", "negative token id", "openai prompt id = vocab")  # may kill plain 0.5.17


def phase_eager(s, model, prompts) -> dict:
    """48 concurrent requests on a server whose graphs stop at batch 8 (eager draft, verify
    and tree stages), a third with a frequency penalty: re-scored."""
    base = [prompts[i % len(prompts)] for i in range(48)]
    params = [dict(temperature=0, max_new_tokens=64, ignore_eos=True,
                   frequency_penalty=1.0 if i % 3 == 0 else 0.0) for i in range(48)]
    res = many(s["ddtree_eager"].url, base, params)
    outs = ids_of(res)
    plain_idx = [i for i in range(48) if i % 3]
    pen_idx = [i for i in range(48) if i % 3 == 0]
    return dict(requests=48, complete=sum(len(o) == 64 for o in outs),
                rescored=teacher_force(model, [base[i] for i in plain_idx],
                                       [outs[i] for i in plain_idx], TIE),
                rescored_frequency_1=teacher_force(model, [base[i] for i in pen_idx],
                                                   [outs[i] for i in pen_idx], TIE,
                                                   RequestPenalties(frequency=1.0)),
                alive=s["ddtree_eager"].alive(), errors=errors(res))


def bad_requests(vocab: int, context: int, prompt: list[int]) -> list[tuple[str, str, object]]:
    sp = dict(max_new_tokens=8)
    gen = "/generate"
    return [
        ("token id = vocab", gen, {"input_ids": prompt[:8] + [vocab], "sampling_params": sp}),
        ("negative token id", gen, {"input_ids": [-3] + prompt[:8], "sampling_params": sp}),
        ("empty input_ids", gen, {"input_ids": [], "sampling_params": sp}),
        ("empty text", gen, {"text": "", "sampling_params": sp}),
        ("temperature -1", gen, {"input_ids": prompt, "sampling_params": dict(sp, temperature=-1)}),
        ("top_p 0", gen, {"input_ids": prompt, "sampling_params": dict(sp, top_p=0)}),
        ("top_k 0", gen, {"input_ids": prompt, "sampling_params": dict(sp, top_k=0)}),
        ("frequency_penalty 5", gen, {"input_ids": prompt,
                                      "sampling_params": dict(sp, frequency_penalty=5)}),
        ("min_new > max_new", gen, {"input_ids": prompt,
                                    "sampling_params": dict(sp, min_new_tokens=20)}),
        ("prompt over the context", gen, {"input_ids": (prompt * 80)[: context + 100],
                                          "sampling_params": sp}),
        ("invalid JSON /generate", gen, b"{not json"),
        ("invalid JSON /v1/completions", "/v1/completions", b"{not json"),
        ("openai prompt id = vocab", "/v1/completions",
         {"model": "x", "prompt": prompt[:8] + [vocab], "max_tokens": 8}),
    ]


def send_raw(url: str, body) -> dict:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            text = r.read().decode(errors="ignore")
            return dict(status=r.status, body=text[:240])
    except urllib.error.HTTPError as e:
        return dict(status=e.code, body=e.read().decode(errors="ignore")[:240])
    except Exception as e:  # noqa: BLE001
        return dict(status=None, body=f"{type(e).__name__}: {e}"[:240])


def phase_bad_inputs(s, vocab: int, context: int, prompt: list[int]) -> dict:
    out = {}
    for name, path, body in bad_requests(vocab, context, prompt):
        row = dict(ddtree=send_raw(s["ddtree"].url + path, body))
        row["ddtree_alive"] = s["ddtree"].alive()
        if name not in KILLS_PLAIN:  # an id >= vocab kills plain SGLang 0.5.17 itself
            row["plain"] = send_raw(s["plain"].url + path, body)
        out[name] = row
    ok = many(s["ddtree"].url, [prompt], dict(temperature=0, max_new_tokens=16, ignore_eos=True))
    out["served_after"] = len(ok[0].get("output_ids") or []) == 16
    return out


def phase_final(s, model, prompts) -> dict:
    res = many(s["ddtree"].url, prompts[:16], dict(temperature=0, max_new_tokens=64, ignore_eos=True))
    out = dict(rescored=teacher_force(model, prompts[:16], ids_of(res), TIE))
    for name, server in s.items():
        if not server.alive():
            out[name] = dict(alive=False)
            continue
        post_json(server.url + "/flush_cache", {})
        time.sleep(3)
        load = get_json(server.url + "/get_load")
        log = server.log_path.read_text(errors="ignore")
        out[name] = dict(alive=True, kv_tokens_after_flush=sum(r.get("num_tokens", 0) for r in load),
                         leak_in_log="memory leak" in log or "leak detected" in log,
                         traceback_in_log="Traceback" in log)
    return out


# -- driver ------------------------------------------------------------------------------------
# The servers each phase talks to (a run of a few phases starts only those).
NEEDS = {"penalties": ("ddtree", "plain", "plain_sync"), "min_new": ("ddtree", "plain_sync"),
         "eos_boundary": ("ddtree", "plain", "plain_sync"), "distribution": ("ddtree", "plain"),
         "context": ("ddtree", "plain"), "retraction": ("ddtree_small",), "aborts": ("ddtree",),
         "shared_prefix": ("ddtree",), "bad_inputs": ("ddtree", "plain"),
         "eager": ("ddtree_eager",), "final": ("ddtree",)}
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--testbed", type=Path, default=ROOT / "testbed")
    ap.add_argument("--budget", type=int, default=32)
    ap.add_argument("--samples", type=int, default=6000, help="distribution phase requests per arm")
    ap.add_argument("--phases", default="penalties,min_new,eos_boundary,distribution,context,"
                    "retraction,aborts,shared_prefix,bad_inputs,eager,final")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    stop_servers_on_sigterm()
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    target, drafter = str(args.testbed / "target"), str(args.testbed / "drafter")
    tok = AutoTokenizer.from_pretrained(target)
    cfg = AutoConfig.from_pretrained(target)
    vocab, context = cfg.vocab_size, cfg.max_position_embeddings
    prompts = [encode_prompt(tok, r) for r in read_prompts(args.testbed / "prompts.jsonl")]
    long_ids = [t for p in prompts for t in p]
    prompts48 = [prompts[i % len(prompts)][: 24 + (i * 37) % 400] for i in range(48)]
    env = {"SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1"}
    n = args.budget + 1
    specs = {"ddtree": ServerSpec(target, "ddtree", "DDTREE", drafter, n, max_total_tokens=120_000,
                                  max_running_requests=32),
             "plain": ServerSpec(target, "plain", max_total_tokens=120_000),
             "plain_sync": ServerSpec(target, "plain_sync", disable_overlap_schedule=True,
                                      max_total_tokens=120_000),
             "ddtree_small": ServerSpec(target, "ddtree_small", "DDTREE", drafter, n,
                                        max_total_tokens=3000),
             # CUDA graphs only up to batch 8: most steps take SGLang's eager paths
             "ddtree_eager": ServerSpec(target, "ddtree_eager", "DDTREE", drafter, n,
                                        max_total_tokens=120_000, cuda_graph_max_bs=8)}
    chosen = args.phases.split(",")
    unknown = [p for p in chosen if p not in NEEDS]
    if unknown:
        ap.error(f"unknown phases {unknown}; accepted: {', '.join(NEEDS)}")
    wanted = set().union(*(NEEDS[p] for p in chosen))  # start only the servers the phases use
    specs = {name: spec for name, spec in specs.items() if name in wanted}
    servers = {}
    for name, spec in specs.items():
        spec.sleep_on_idle = True
        servers[name] = Server(spec, args.out / f"server_{name}.log", env=env)
    t0 = time.time()
    for server in servers.values():
        server.launch()
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).cuda().eval()
    meta = dict(date=time.strftime("%Y-%m-%d"), device=torch.cuda.get_device_name(),
                command="python tests/gpu/reliability.py " + " ".join(sys.argv[1:]),
                budget=args.budget, context=context, vocab=vocab)
    results: dict = {"meta": meta}

    def write():
        (args.out / "reliability.json").write_text(json.dumps(results, indent=1))
    try:
        for name, server in servers.items():
            server.wait_healthy(timeout=max(60.0, 420 - (time.time() - t0)))
            meta[f"{name}_healthy_after_s"] = round(time.time() - t0, 1)
        stops = stopping_requests(servers, prompts) if "plain_sync" in servers else []
        meta["stopping_requests"] = len(stops)
        phases = {
            "penalties": lambda: phase_penalties(servers, model, prompts48),
            "min_new": lambda: phase_min_new(servers, stops),
            "eos_boundary": lambda: phase_eos_boundary(servers, stops, tok),
            "distribution": lambda: phase_distribution(
                servers, model, pick_flat_prompt(model, prompts, 20, 0.8), args.samples),
            "context": lambda: phase_context(servers, model, long_ids, context),
            "retraction": lambda: phase_retraction(servers, model, prompts),
            "aborts": lambda: phase_aborts(servers, prompts),
            "shared_prefix": lambda: phase_shared_prefix(servers, model, long_ids, prompts),
            "bad_inputs": lambda: phase_bad_inputs(servers, vocab, context, prompts[0][:32]),
            "eager": lambda: phase_eager(servers, model, prompts),
            "final": lambda: phase_final(servers, model, prompts),
        }
        for name in chosen:
            t = time.time()
            try:
                results[name] = phases[name]()
            except Exception as exc:  # noqa: BLE001 - record and go on
                results[name] = dict(error=f"{type(exc).__name__}: {exc}"[:600])
            results[name + "_seconds"] = round(time.time() - t, 1)
            print(name, json.dumps(results[name])[:1500], flush=True)
            write()
    finally:
        for server in servers.values():
            server.stop()
        write()


if __name__ == "__main__":
    main()
