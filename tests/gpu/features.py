"""Request features through DDTREE against plain SGLang, on the GPU machine, in one call:
structured output (json_schema, regex, ebnf, tool calls), logprobs, a mixed batch, bad
grammars, and what a grammar or logprobs cost per step.

    source scripts/checkout_env.sh && python tests/gpu/features.py --out $OUT

Servers on the shipped testbed pair, started together: plain SGLang, DDTREE with its defaults,
DFLASH (the feature table's middle column), all triton, with
--constrained-json-disable-any-whitespace (the testbed model writes code: with free
whitespace a JSON object may never close).  Checks, each against plain SGLang's answer to the
same request:
  grammar    greedy, 48 requests per kind: outputs equal to plain's (a difference is re-scored
             by the target in float32: a near-tie or not), every output parses and validates;
  sampled    T = 0.7 json_schema, 256 requests per arm on one prompt: all valid, and the
             distribution of the values chosen compared with plain's (chi-square homogeneity);
  logprobs   greedy, 32 requests x 64 tokens, top_logprobs 5, input logprobs: each logprob
             within 0.02 of plain's, top-5 sets equal except near-ties; T = 1: each returned
             logprob is the target's own (float32 re-scored) for the emitted token; the OpenAI
             chat / completions forms, streaming included;
  mixed      32 concurrent requests (grammar, logprobs, penalties, greedy, seeded sampling),
             each row against its own single-request run; KV after /flush_cache, server alive
             (strict idle memory check on);
  errors     bad regex / json schema / ebnf: plain's status, DDTREE's status, server alive;
  n > 1      chat with a json_schema response format, n = 3;
  speed      tok/s of plain, json_schema and logprob requests at concurrency 1 and 16.
Writes features.json under --out after every section and prints a table last.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from rescoring import chi2_pvalue, first_divergences  # noqa: E402
from ddtree_bench.server import (Server, ServerSpec, get_json, post_json,  # noqa: E402
                                        stop_servers_on_sigterm)
from ddtree_sglang.reference.testbed import encode_prompt, read_prompts  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "name": {"enum": ["ada", "bob", "cy"]}, "ok": {"type": "boolean"},
    "tag": {"enum": ["x", "y", "z", "w"]}},
    "required": ["name", "ok", "tag"], "additionalProperties": False}
REGEX = r"(cat|dog|bird)-[0-9]{2,3}-(red|blue)"
EBNF = 'root ::= answer " " num\nanswer ::= "yes" | "no" | "maybe"\nnum ::= [0-9] [0-9]?'
EBNF_AS_REGEX = r"(yes|no|maybe) [0-9][0-9]?"
TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"enum": ["paris", "rome", "oslo"]}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIE = 0.05  # float32 logit gap below which two greedy choices are a near-tie
SECTIONS = ("grammar", "tools", "sampled", "logprobs", "mixed", "errors", "n", "speed", "probe")


def pool_map(fn, items, workers: int = 64) -> list:
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(fn, items))


def generate(url: str, ids: list[int], sampling: dict, **extra) -> dict:
    """One /generate request; a dropped connection (a server that died) is an error row."""
    try:
        return post_json(url + "/generate", {"input_ids": ids, "sampling_params": sampling,
                                             **extra})
    except OSError as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def valid_json(text: str) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    except Exception:  # noqa: BLE001 - any failure: not valid
        return False


def compare_ids(model, prompts, outs: list, refs: list) -> dict:
    """Token-identical outputs, and where not, the float32 gap at the first divergence."""
    same = sum(a == b for a, b in zip(outs, refs))
    div = first_divergences(model, prompts, outs, refs, limit=len(outs))
    return dict(requests=len(outs), identical=same,
                differ_at_near_tie=sum(abs(d["gap"]) <= TIE for d in div),
                differ_not_tie=sum(abs(d["gap"]) > TIE for d in div),
                gaps=[d["gap"] for d in div][:8])


def grammar_checks(urls: dict, prompts: list, texts: list, model) -> dict:
    """Greedy with each grammar kind on every arm; DDTREE and DFLASH against plain."""
    kinds = {"json_schema": (dict(json_schema=json.dumps(SCHEMA)), valid_json),
             "regex": (dict(regex=REGEX), lambda t: re.fullmatch(REGEX, t) is not None),
             "ebnf": (dict(ebnf=EBNF), lambda t: re.fullmatch(EBNF_AS_REGEX, t) is not None)}
    out: dict = {}
    for kind, (constraint, valid) in kinds.items():
        sp = dict(temperature=0.0, max_new_tokens=96, **constraint)
        runs = {arm: pool_map(lambda p: generate(url, p, sp), prompts) for arm, url in urls.items()}
        out[kind] = {}
        for arm, res in runs.items():
            ids = [r.get("output_ids") or [] for r in res]
            row = dict(valid=sum(valid(r.get("text", "")) for r in res), requests=len(res),
                       errors=[r["error"] for r in res if "error" in r][:2],
                       example=res[0].get("text", "")[:80])
            if arm != "plain":
                row.update(compare_ids(model, prompts, ids,
                                       [r.get("output_ids") or [] for r in runs["plain"]]))
            out[kind][arm] = row
    return out


def tool_calls(urls: dict, texts: list) -> dict:
    """/v1/chat/completions with tools, tool_choice "required" and a named function."""
    def ask(url, i):
        choice = "required" if i % 2 == 0 else {"type": "function",
                                                 "function": {"name": "get_weather"}}
        return post_json(url + "/v1/chat/completions", {
            "model": "x", "messages": [{"role": "user", "content": texts[i % len(texts)]}],
            "tools": [TOOL], "tool_choice": choice, "parallel_tool_calls": False,
            "temperature": 0, "max_tokens": 96})

    def calls(r):
        """The tool calls: message.tool_calls with a tool-call parser; without one SGLang
        0.5.17 returns the constrained JSON array [{name, parameters}] as the content."""
        msg = ((r.get("choices") or [{}])[0]).get("message") or {}
        if msg.get("tool_calls"):
            return [(c["function"]["name"], c["function"]["arguments"])
                    for c in msg["tool_calls"]]
        try:
            return [(c["name"], json.dumps(c["parameters"]))
                    for c in json.loads(msg.get("content") or "")]
        except (ValueError, TypeError, KeyError):
            return []

    def valid(call_list):
        import jsonschema

        try:
            for name, args in call_list:
                jsonschema.validate(json.loads(args), TOOL["function"]["parameters"])
            return bool(call_list) and all(n == "get_weather" for n, _ in call_list)
        except Exception:  # noqa: BLE001
            return False

    runs = {arm: pool_map(lambda i: ask(url, i), range(48)) for arm, url in urls.items()}
    ref = [calls(r) for r in runs["plain"]]
    out = {}
    for arm, res in runs.items():
        got = [calls(r) for r in res]
        out[arm] = dict(requests=len(res), valid=sum(valid(c) for c in got),
                        identical_to_plain=sum(a == b for a, b in zip(got, ref)),
                        errors=[r["error"] for r in res if "error" in r][:2],
                        example=str(got[0])[:100])
    return out


def sampled_json(urls: dict, prompt: list[int], n: int = 256) -> dict:
    """T = 0.7 json_schema on one prompt: validity, and the chosen values' distribution
    against plain's (chi-square test of homogeneity over the value combinations)."""
    sp = dict(temperature=0.7, max_new_tokens=96, json_schema=json.dumps(SCHEMA))
    counts, out = {}, {}
    for arm in ("plain", "ddtree"):
        res = pool_map(lambda _: generate(urls[arm], prompt, sp), range(n))
        texts = [r.get("text", "") for r in res]
        ok = [t for t in texts if valid_json(t)]
        out[arm] = dict(requests=n, valid=len(ok))
        counts[arm] = {}
        for t in ok:
            v = json.loads(t)
            key = f"{v['name']}/{v['ok']}/{v['tag']}"
            counts[arm][key] = counts[arm].get(key, 0) + 1
    keys = sorted(set(counts["plain"]) | set(counts["ddtree"]))
    table = torch.tensor([[counts[a].get(k, 0) for k in keys] for a in ("plain", "ddtree")],
                         dtype=torch.float64)
    keep = table.sum(0) > 0
    table = table[:, keep]
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    stat = float(((table - expected) ** 2 / expected).sum())
    df = table.shape[1] - 1
    out["values"] = {a: counts[a] for a in counts}
    out["chi_square"] = dict(statistic=round(stat, 2), df=df,
                             p_value=round(chi2_pvalue(stat, df), 4) if df > 0 else None)
    return out


def logprob_checks(urls: dict, prompts: list, texts: list, model) -> dict:
    out = {}
    sp = dict(temperature=0.0, max_new_tokens=64, ignore_eos=True)
    extra = dict(return_logprob=True, top_logprobs_num=5, logprob_start_len=0,
                 return_text_in_logprobs=True)
    runs = {a: pool_map(lambda p: generate(urls[a], p, sp, **extra), prompts)
            for a in ("plain", "ddtree")}
    out["greedy"] = compare_logprobs(runs["plain"], runs["ddtree"])
    out["greedy"]["ids"] = compare_ids(model, prompts, [r.get("output_ids") or [] for r in runs["ddtree"]],
                                       [r.get("output_ids") or [] for r in runs["plain"]])
    sp1 = dict(temperature=1.0, max_new_tokens=64, ignore_eos=True)
    for arm in ("plain", "ddtree"):
        res = pool_map(lambda p: generate(urls[arm], p, sp1, return_logprob=True), prompts)
        out[f"sampled_{arm}"] = emitted_logprobs(model, prompts, res)
    out["openai"] = openai_logprobs(urls["ddtree"], urls["plain"], texts[0])
    return out


def compare_logprobs(plain: list, ddtree: list) -> dict:
    """Per output position of equal tokens: |logprob difference|, top-5 sets (a differing set
    counts as a near-tie when the swapped tokens sit within 0.02 of the 5th value); input
    logprobs."""
    worst = 0.0
    beyond = positions = top_differ = top_differ_not_tie = 0
    input_worst = 0.0
    for p, d in zip(plain, ddtree):
        mp, md = p.get("meta_info", {}), d.get("meta_info", {})
        for a, b in zip(mp.get("input_token_logprobs") or [], md.get("input_token_logprobs") or []):
            if a[0] is not None and b[0] is not None:
                input_worst = max(input_worst, abs(a[0] - b[0]))
        for j, (a, b) in enumerate(zip(mp.get("output_token_logprobs") or [],
                                       md.get("output_token_logprobs") or [])):
            if a[1] != b[1]:
                break  # the outputs diverged (compare_ids says why); stop at the split
            positions += 1
            diff = abs(a[0] - b[0])
            worst = max(worst, diff)
            beyond += diff > 0.02
            ta = {t[1]: t[0] for t in mp["output_top_logprobs"][j]}
            tb = {t[1]: t[0] for t in md["output_top_logprobs"][j]}
            if set(ta) != set(tb):
                top_differ += 1
                fifth = min(min(ta.values()), min(tb.values()))
                swapped = [v for k, v in {**ta, **tb}.items() if k not in ta or k not in tb]
                if any(v - fifth > 0.02 for v in swapped):
                    top_differ_not_tie += 1
    return dict(positions=positions, max_abs_diff=round(worst, 5), beyond_0_02=beyond,
                top5_sets_differ=top_differ, top5_differ_not_tie=top_differ_not_tie,
                input_logprobs_max_abs_diff=round(input_worst, 6))


@torch.no_grad()
def emitted_logprobs(model, prompts: list, res: list) -> dict:
    """Each returned logprob against the target's float32 log-probability of the token the
    server emitted at that position (T = 1: the distribution is the logits' own)."""
    dev = next(model.parameters()).device
    worst, beyond, n = 0.0, 0, 0
    for p, r in zip(prompts, res):
        lps = (r.get("meta_info") or {}).get("output_token_logprobs") or []
        ids = r.get("output_ids") or []
        if not lps or not ids:
            continue
        logits = model(torch.tensor([p + ids], device=dev)).logits[0, len(p) - 1:-1].float()
        ref = torch.log_softmax(logits, -1)
        for j, (lp, tok) in enumerate(zip(lps, ids)):
            if lp[1] != tok:
                beyond += 1  # a logprob for another token than the one emitted
                continue
            d = abs(lp[0] - float(ref[j, tok]))
            worst, beyond, n = max(worst, d), beyond + (d > 0.05), n + 1
    return dict(tokens=n, max_abs_diff_vs_float32=round(worst, 4), beyond_0_05=beyond)


def openai_logprobs(url: str, plain_url: str, text: str) -> dict:
    """The OpenAI forms: chat (logprobs + top_logprobs 5), its stream, completions
    (logprobs 5); DDTREE's values against plain's on the same requests."""
    chat = {"model": "x", "messages": [{"role": "user", "content": text}], "temperature": 0,
            "max_tokens": 32, "logprobs": True, "top_logprobs": 5}
    comp = {"model": "x", "prompt": text, "temperature": 0, "max_tokens": 32, "logprobs": 5}

    def chat_lps(r):
        content = ((r.get("choices") or [{}])[0].get("logprobs") or {}).get("content") or []
        return [(c["token"], c["logprob"], len(c.get("top_logprobs") or [])) for c in content]

    a = post_json(url + "/v1/chat/completions", chat)
    b = post_json(plain_url + "/v1/chat/completions", chat)
    stream = stream_chat(url, chat)
    ca = post_json(url + "/v1/completions", comp)
    cb = post_json(plain_url + "/v1/completions", comp)

    def comp_lps(r):
        lp = (r.get("choices") or [{}])[0].get("logprobs") or {}
        return list(zip(lp.get("tokens") or [], lp.get("token_logprobs") or [],
                        [len(t or {}) for t in lp.get("top_logprobs") or []]))

    def close(x: list, y: list) -> bool:
        """Same tokens and top-k sizes, logprobs within 0.02 (bf16 / fp16 kernels)."""
        return len(x) == len(y) and all(
            t == u and k == m and abs(p - q) <= 0.02 for (t, p, k), (u, q, m) in zip(x, y))

    return dict(chat_tokens=len(chat_lps(a)), chat_close_to_plain=close(chat_lps(a), chat_lps(b)),
                chat_top5_everywhere=all(k == 5 for _, _, k in chat_lps(a)),
                stream_close_to_non_stream=close(stream, chat_lps(a)),
                completions_close_to_plain=close(comp_lps(ca), comp_lps(cb)),
                completions_tokens=len(comp_lps(ca)),
                chat_first=chat_lps(a)[:4], chat_plain_first=chat_lps(b)[:4],
                stream_first=stream[:4], completions_first=comp_lps(ca)[:4],
                completions_plain_first=comp_lps(cb)[:4],
                errors=[x["error"] for x in (a, b, ca, cb) if "error" in x])


def stream_chat(url: str, body: dict) -> list:
    import urllib.request

    req = urllib.request.Request(url + "/v1/chat/completions",
                                 data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    got = []
    with urllib.request.urlopen(req, timeout=120) as r:
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for ch in chunk.get("choices") or []:
                for c in (ch.get("logprobs") or {}).get("content") or []:
                    got.append((c["token"], c["logprob"], len(c.get("top_logprobs") or [])))
    return got


def mixed_batch(url: str, prompts: list, model) -> dict:
    """32 concurrent requests of five kinds, each against its own single-request run."""
    kinds = []
    for i in range(32):
        k = i % 5
        sp = dict(max_new_tokens=48, temperature=0.0)
        extra = {}
        if k == 0:
            sp["json_schema"] = json.dumps(SCHEMA)
        elif k == 1:
            extra = dict(return_logprob=True, top_logprobs_num=3)
            sp["ignore_eos"] = True
        elif k == 2:
            sp.update(frequency_penalty=0.5, repetition_penalty=1.2, ignore_eos=True)
        elif k == 3:
            sp["ignore_eos"] = True
        else:
            sp.update(temperature=0.8, top_p=0.9, sampling_seed=1000 + i, ignore_eos=True)
        kinds.append((["grammar", "logprobs", "penalties", "greedy", "seeded"][k], sp, extra))
    batched = pool_map(lambda i: generate(url, prompts[i % len(prompts)], kinds[i][1],
                                          **kinds[i][2]), range(32), workers=32)
    alone = [generate(url, prompts[i % len(prompts)], kinds[i][1], **kinds[i][2])
             for i in range(32)]
    rows = {}
    for i, (kind, _, _) in enumerate(kinds):
        a, b = batched[i].get("output_ids"), alone[i].get("output_ids")
        row = rows.setdefault(kind, dict(requests=0, equal=0, differ=[]))
        row["requests"] += 1
        if a == b and a:
            row["equal"] += 1
        elif kind != "seeded":  # greedy kinds: where they split, re-scored
            d = first_divergences(model, [prompts[i % len(prompts)]], [a or []], [b or []])
            row["differ"].append(d[0]["gap"] if d else "empty")
        else:  # SGLang samples the first token in its prefill, seeded only with
            # --enable-deterministic-inference: the rest is DDTREE's, seeded per position
            same_first = bool(a and b and a[0] == b[0])
            row["differ"].append("differs after the same first token" if same_first
                                 else "the unseeded first (prefill) token differs")
    post_json(url + "/flush_cache", {})
    time.sleep(3)
    load = get_json(url + "/get_load")
    return dict(rows=rows, kv_tokens_after_flush=sum(r.get("num_tokens", 0) for r in load),
                errors=[r["error"] for r in batched + alone if "error" in r][:3])


def bad_grammars(urls: dict, prompt: list[int]) -> dict:
    cases = {"regex": dict(regex="(unclosed"), "json_schema": dict(json_schema='{"type": 7}'),
             "ebnf": dict(ebnf="root ::= (")}
    out = {}
    for name, c in cases.items():
        out[name] = {}
        for arm, url in urls.items():
            r = generate(url, prompt, dict(max_new_tokens=8, **c))
            err = r.get("error") or {}
            out[name][arm] = dict(status=err.get("status", 200),
                                  message=str(err.get("body", r.get("meta_info", {}).get(
                                      "finish_reason")))[:120])
    fmt = {"model": "x", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
           "response_format": {"type": "json_schema",
                               "json_schema": {"name": "bad", "schema": {"type": 7}}}}
    out["openai_json_schema"] = {arm: (post_json(url + "/v1/chat/completions", fmt).get(
        "error") or {}).get("status", 200) for arm, url in urls.items()}
    return out


def n_choices(url: str, text: str) -> dict:
    body = {"model": "x", "messages": [{"role": "user", "content": text}], "n": 3,
            "temperature": 0.8, "max_tokens": 96,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "pick", "schema": SCHEMA}}}
    r = post_json(url + "/v1/chat/completions", body)
    texts = [c["message"]["content"] for c in r.get("choices") or []]
    return dict(choices=len(texts), valid=sum(valid_json(t) for t in texts),
                error=r.get("error"))


def speed(urls: dict, prompts: list) -> dict:
    """Output tok/s of plain, grammar and logprob requests at concurrency 1 and 16 (median
    of 3 rounds, the kinds interleaved in each round)."""
    long_regex = "[a-z ]{120,160}"
    kinds = {"plain": (dict(), {}), "regex": (dict(regex=long_regex), {}),
             "logprobs": (dict(), dict(return_logprob=True, top_logprobs_num=5))}
    out: dict = {}
    for arm in ("plain", "ddtree"):
        for conc in (1, 16):
            rates: dict = {k: [] for k in kinds}
            accept: dict = {k: [] for k in kinds}
            for _ in range(3):
                for kind, (c, extra) in kinds.items():
                    n = 8 if conc == 1 else 64
                    sp = dict(temperature=0.0, max_new_tokens=128, ignore_eos=not c, **c)
                    t0 = time.time()
                    res = pool_map(lambda i: generate(urls[arm], prompts[i % len(prompts)], sp,
                                                      **extra), range(n), workers=conc)
                    wall = time.time() - t0
                    toks = sum(len(r.get("output_ids") or []) for r in res)
                    rates[kind].append(toks / wall)
                    acc = [r["meta_info"].get("spec_accept_length") for r in res
                           if r.get("meta_info", {}).get("spec_accept_length")]
                    accept[kind].append(statistics.mean(acc) if acc else None)
            out[f"{arm}@{conc}"] = {k: dict(tok_s=round(statistics.median(v), 1),
                                            accept=accept[k][0] and round(accept[k][0], 2))
                                    for k, v in rates.items()}
    return out


def feature_probe(url: str, prompt: list[int], text: str) -> dict:
    """Whether an arm serves each request feature (one request each)."""
    out = {}
    for name, c in {"json_schema": dict(json_schema=json.dumps(SCHEMA)), "regex": dict(regex=REGEX),
                    "ebnf": dict(ebnf=EBNF)}.items():
        r = generate(url, prompt, dict(max_new_tokens=64, temperature=0, **c))
        out[name] = "served" if "error" not in r else f"refused: {str(r['error'])[:100]}"
    r = generate(url, prompt, dict(max_new_tokens=8), return_logprob=True, top_logprobs_num=2)
    reason = (r.get("meta_info") or {}).get("finish_reason") or {}
    out["logprobs"] = "served" if (r.get("meta_info") or {}).get("output_token_logprobs") \
        else f"refused: {str(r.get('error') or reason)[:100]}"
    t = post_json(url + "/v1/chat/completions", {
        "model": "x", "messages": [{"role": "user", "content": text}], "tools": [TOOL],
        "tool_choice": "required", "max_tokens": 64, "temperature": 0})
    msg = ((t.get("choices") or [{}])[0]).get("message") or {}
    out["tool_call"] = "served" if msg.get("tool_calls") or msg.get("content", "").startswith(
        "[{") else f"refused: {str(t)[:100]}"
    return out


def knob_settings(text: str) -> dict[str, str]:
    """"K=V,K=V" -> {K: V}, each a DDTREE knob setting (settings.check_env's errors)."""
    from ddtree_sglang.sglang_plugin.settings import DDTreeConfigError, check_env

    out = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        name, sep, value = item.partition("=")
        try:
            if not sep:
                raise DDTreeConfigError(f"{item!r} is not NAME=value")
            check_env(name, value)
        except DDTreeConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        out[name] = value
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--testbed", type=Path, default=ROOT / "testbed")
    ap.add_argument("--sections", default=",".join(SECTIONS),
                    help="comma list of " + ", ".join(SECTIONS))
    ap.add_argument("--ddtree-env", type=knob_settings, default={},
                    help="comma list of SGLANG_DDTREE_*=value for the DDTREE server (e.g. "
                         "SGLANG_DDTREE_GRAMMAR=path), checked like a server's")
    args = ap.parse_args()
    unknown = sorted(set(args.sections.split(",")) - set(SECTIONS))
    if unknown:
        ap.error(f"--sections: unknown {', '.join(unknown)}; accepted: {', '.join(SECTIONS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    stop_servers_on_sigterm()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target, drafter = str(args.testbed / "target"), str(args.testbed / "drafter")
    tok = AutoTokenizer.from_pretrained(target)
    rows = read_prompts(args.testbed / "prompts.jsonl")
    base = [encode_prompt(tok, r) for r in rows]
    prompts = [base[i % len(base)][: 16 + 8 * (i // len(base))] for i in range(48)]
    texts = [tok.decode(p[:48]) for p in base]
    extra = ["--constrained-json-disable-any-whitespace"]
    specs = {"plain": ServerSpec(target, "plain", extra_args=extra),
             "ddtree": ServerSpec(target, "ddtree", "DDTREE", drafter, extra_args=extra,
                                  env=args.ddtree_env),
             "dflash": ServerSpec(target, "dflash", "DFLASH", drafter, extra_args=extra)}
    servers = {}
    for name, spec in specs.items():
        # graphs up to 64: DFLASH's eager path hands the fp16 testbed drafter bf16 embeddings
        # in SGLang 0.5.17 and fails above the largest captured batch
        spec.max_total_tokens, spec.sleep_on_idle, spec.cuda_graph_max_bs = 200_000, True, 64
        spec.max_running_requests = 64
        servers[name] = Server(spec, args.out / f"server_{name}.log",
                               env={"SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1"})
        servers[name].launch()
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).cuda().eval()
    results: dict = dict(meta=dict(date=time.strftime("%Y-%m-%d"),
                                   device=torch.cuda.get_device_name(),
                                   command="python tests/gpu/features.py " + " ".join(sys.argv[1:])))

    def save():
        (args.out / "features.json").write_text(json.dumps(results, indent=1))

    try:
        for s in servers.values():
            s.wait_healthy(600)
        urls = {k: s.url for k, s in servers.items()}
        both = {k: urls[k] for k in ("plain", "ddtree")}
        sections = {
            "grammar": lambda: grammar_checks(urls, prompts, texts, model),
            "tools": lambda: tool_calls(urls, texts),
            "sampled": lambda: sampled_json(urls, prompts[0]),
            "logprobs": lambda: logprob_checks(urls, prompts[:32], texts, model),
            "mixed": lambda: mixed_batch(urls["ddtree"], prompts, model),
            "errors": lambda: bad_grammars(both, prompts[0]),
            "n": lambda: n_choices(urls["ddtree"], texts[1]),
            "probe": lambda: {k: feature_probe(u, prompts[0], texts[0]) for k, u in urls.items()},
            "speed": lambda: speed(both, prompts),
        }
        for name in args.sections.split(","):
            t0 = time.time()
            try:
                results[name] = sections[name]()
            except Exception as exc:  # noqa: BLE001 - report, go on with the next section
                results[name] = dict(error=f"{type(exc).__name__}: {exc}"[:500])
            results.setdefault("seconds", {})[name] = round(time.time() - t0, 1)
            print(name, json.dumps(results[name])[:1500], flush=True)
            save()
    finally:
        for name, s in servers.items():
            log = s.log_path.read_text(errors="ignore") if s.log_path.exists() else ""
            results.setdefault("health", {})[name] = dict(
                alive=s.alive(), leak_in_log="memory leak" in log or "use-after-free" in log,
                traceback_in_log="Traceback" in log)
            s.stop()
        save()
    print(json.dumps(results.get("health")))


if __name__ == "__main__":
    main()
