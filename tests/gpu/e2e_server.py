"""End-to-end check of DDTREE in the real SGLang HTTP server, on the GPU machine, in one call.

    source scripts/checkout_env.sh && python tests/gpu/e2e_server.py --out $OUT

For each arm (DDTREE, DFLASH, no speculation) on the shipped testbed pair it launches
`python -m sglang.launch_server`, then checks: /v1/completions and /v1/chat/completions answer;
greedy outputs for the held-out prompts, sent concurrently, are the target's own greedy choices
(every emitted token is re-scored by the target in float32 with transformers: it must be the
argmax, or within --tie-tol logits of it); temperature-1 outputs have the target's own mean
log-likelihood (mean NLL of the sampled tokens vs mean entropy at those positions); 24
concurrent requests of different lengths (greedy, T=1, top-p, top-k, min-p, frequency and
repetition penalties); n=2 through /v1/completions; a logprob request is refused with a message and the
server stays up; after /flush_cache the KV pool holds no tokens.  Prints a table last and writes
e2e.json under --out.  A generated testbed (--testbed testbed_hybrid) gets its untracked weights
written first, checked against its made_with.json; a gated-delta target is served in bfloat16.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from rescoring import first_divergences, teacher_force  # noqa: E402
from ddtree_bench.server import (Server, ServerSpec, get_json, post_json,  # noqa: E402
                                        stop_servers_on_sigterm)
from ddtree_sglang.reference.testbed import encode_prompt, read_prompts  # noqa: E402


def restore_generated(testbed: Path) -> None:
    """A generated testbed (one with a made_with.json: testbed_hybrid/) travels without its
    weights and tokenizer.json (untracked, 11 MB): write them before anything reads them, and
    stop, the script's one-line error last, unless they are the recorded bytes."""
    if not (testbed / "made_with.json").is_file():
        return
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "make_hybrid_testbed.py"),
                           "--source", str(ROOT / "testbed"), "--out", str(testbed),
                           "--restore"])
    if done.returncode:
        sys.exit(done.returncode)


def serving_dtype(target: Path) -> str:
    """bfloat16 for a gated-delta hybrid target, else float16: in float16 plain SGLang 0.5.17
    itself fails to start on one (its _causal_conv1d_fn_triton does not compile: "Mismatched
    type for col0 between then block (bf16) and else block (fp16)"; fixed in SGLang 0.5.20,
    #38039)."""
    layers = json.loads((target / "config.json").read_text()).get("layer_types") or []
    return "bfloat16" if "linear_attention" in layers else "float16"


def load_prompts(tok, path: Path, limit: int) -> list[list[int]]:
    return [encode_prompt(tok, r) for r in read_prompts(path)[:limit]]


def generate(url: str, prompts: list[list[int]], params: list[dict], workers: int = 32):
    def one(i):
        return post_json(url + "/generate", {"input_ids": prompts[i], "sampling_params": params[i]})
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(one, range(len(prompts))))


def check_arm(server: Server, t_launch: float, prompts, max_new: int) -> dict:
    """All request-level checks of one arm; the server was launched at `t_launch`."""
    res: dict = {"arm": server.spec.name, "dtype": server.spec.dtype}
    try:
        server.wait_healthy(timeout=max(60.0, 480 - (time.time() - t_launch)))
    except Exception as exc:  # noqa: BLE001 - report and go on with the other arms
        res["error"] = f"startup failed: {exc}"[-3000:]
        return res
    res["healthy_after_s"] = round(time.time() - t_launch, 1)
    try:
        url = server.url
        c = post_json(url + "/v1/completions", {"model": "x", "prompt": "def main():\n",
                                                "max_tokens": 24, "temperature": 0})
        ch = post_json(url + "/v1/chat/completions", {"model": "x", "max_tokens": 24,
                       "messages": [{"role": "user", "content": "Write a Python loop."}]})
        res["openai_completions"] = bool(c.get("choices")) and bool(c["choices"][0].get("text"))
        res["openai_chat"] = bool(ch.get("choices")) and bool(ch["choices"][0]["message"].get("content"))
        two = post_json(url + "/v1/completions", {"model": "x", "prompt": "import os\n", "n": 2,
                                                  "max_tokens": 16, "temperature": 0.8})
        res["openai_n2_choices"] = len(two.get("choices") or [])
        greedy = dict(temperature=0.0, max_new_tokens=max_new, ignore_eos=True)
        t1 = time.time()
        g = generate(url, prompts, [greedy] * len(prompts))
        res["greedy_seconds"] = round(time.time() - t1, 2)
        res["greedy_outputs"] = [r.get("output_ids") for r in g]
        res["greedy_errors"] = [r["error"] for r in g if "error" in r][:3]
        acc = [r["meta_info"].get("spec_accept_length") for r in g if "meta_info" in r]
        acc = [a for a in acc if a is not None]
        res["accept_length"] = round(sum(acc) / len(acc), 3) if acc else None
        # the batch-aware budget: meta_info["ddtree_budget"] holds each decode step's budget
        steps = [b for r in g for b in (r.get("meta_info", {}).get("ddtree_budget") or [])
                 if b is not None]
        res["budget_steps"] = {str(b): steps.count(b) for b in sorted(set(steps))}
        sample = dict(temperature=1.0, max_new_tokens=max_new, ignore_eos=True)
        s = generate(url, prompts, [sample] * len(prompts))
        res["sampled_outputs"] = [r.get("output_ids") for r in s]
        mixed_prompts = [prompts[i % len(prompts)][: 8 + 7 * i] for i in range(24)]
        mixed_params = [dict(temperature=0.0 if i % 2 == 0 else 1.0, top_p=0.95 if i % 4 == 1 else 1.0,
                             top_k=20 if i % 4 == 3 else -1, max_new_tokens=8 + 4 * i, ignore_eos=True)
                        for i in range(24)]
        for i in range(24):  # sampled rows only: the greedy rows are re-scored by the target
            if i % 8 == 5:
                mixed_params[i]["min_p"] = 0.05
            if i % 8 == 7:
                mixed_params[i]["frequency_penalty"] = 0.3
            if i % 8 == 3:
                mixed_params[i]["repetition_penalty"] = 1.1
        m = generate(url, mixed_prompts, mixed_params)
        res["mixed_ok"] = sum(len(r.get("output_ids") or []) == p["max_new_tokens"]
                              for r, p in zip(m, mixed_params))
        res["mixed_prompts"] = [mixed_prompts[i] for i in range(0, 24, 2)]
        res["mixed_greedy_outputs"] = [m[i].get("output_ids") for i in range(0, 24, 2)]
        bad = post_json(url + "/generate", {"input_ids": prompts[0], "return_logprob": True,
                                            "sampling_params": {"max_new_tokens": 8}})
        res["logprob_request"] = (json.dumps(bad)[:300])
        post_json(url + "/flush_cache", {})
        time.sleep(3)
        load = get_json(url + "/get_load")
        res["kv_tokens_after_flush"] = sum(r.get("num_tokens", 0) for r in load)
        res["alive_at_end"] = server.alive()
    except Exception as exc:  # noqa: BLE001
        res["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        log = server.log_tail(400)
        res["leak_in_log"] = "memory leak" in log or "use-after-free" in log
        # which DDTREE kernels served (the "DDTREE ready" line lists "<kernel> not used: why")
        full = server.log_path.read_text(errors="ignore")
        res["ddtree_fallbacks"] = [part.strip()[:160] for line in full.splitlines()
                                   if "DDTREE ready" in line
                                   for part in line.split(";") if " not used: " in part]
        res["verify_attention"] = next((v for v in ("split", "kernel")
                                        if f"DDTREE verify attention: {v}" in full), "single")
        res["budget_log"] = [line.split("DDTREE ", 1)[1][:300] for line in full.splitlines()
                             if "DDTREE batch-aware budget" in line
                             or "DDTREE budget: batch size" in line][:12]
        res["traceback_in_log"] = "Traceback" in log
        server.stop()
    return res


def score(model, prompts, r: dict, tie_tol: float) -> None:
    """Re-score the arm's greedy and sampled outputs with the target (adds *_check keys)."""
    if r.get("greedy_outputs") and all(r["greedy_outputs"]):
        r["greedy_check"] = teacher_force(model, prompts, r["greedy_outputs"], tie_tol)
        mg = [o for o in r.get("mixed_greedy_outputs", []) if o]
        r["mixed_greedy_check"] = teacher_force(model, r["mixed_prompts"][: len(mg)], mg, tie_tol)
    if r.get("sampled_outputs") and all(r["sampled_outputs"]):
        r["sampling_check"] = teacher_force(model, prompts, r["sampled_outputs"], 1e9)


def summarize(r: dict) -> dict:
    return {k: v for k, v in r.items() if not k.endswith(("outputs", "prompts"))}


def write(out: Path, results: list[dict]) -> None:
    """e2e.json after every arm, so a run cut short keeps what it checked."""
    meta = dict(date=time.strftime("%Y-%m-%d"), device=torch.cuda.get_device_name(),
                command="python tests/gpu/e2e_server.py " + " ".join(sys.argv[1:]))
    (out / "e2e.json").write_text(json.dumps(dict(meta=meta, arms=[summarize(r) for r in results]),
                                             indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--testbed", type=Path, default=ROOT / "testbed")
    ap.add_argument("--prompts", type=int, default=32,
                    help="greedy prompts sent at once; 32 (all the testbed has) reaches the split "
                    "verify attention, used from 32 requests a verify")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--budget", type=int, default=32)
    ap.add_argument("--arms", default="ddtree_triton,dflash_triton,plain_triton")
    ap.add_argument("--tie-tol", type=float, default=0.05)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    stop_servers_on_sigterm()
    restore_generated(args.testbed)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target, drafter = str(args.testbed / "target"), str(args.testbed / "drafter")
    dtype = serving_dtype(args.testbed / "target")
    tok = AutoTokenizer.from_pretrained(target)
    prompts = load_prompts(tok, args.testbed / "prompts.jsonl", args.prompts)
    specs = {
        "ddtree_triton": ServerSpec(target, "ddtree_triton", "DDTREE", drafter, args.budget + 1),
        "ddtree_flashinfer": ServerSpec(target, "ddtree_flashinfer", "DDTREE", drafter,
                                        args.budget + 1, attention_backend="flashinfer"),
        # the budget pinned to B (the other DDTREE arms choose per batch, the default)
        "ddtree_fixed": ServerSpec(target, "ddtree_fixed", "DDTREE", drafter, args.budget + 1,
                                   env={"SGLANG_DDTREE_BUDGETS": "off"}),
        # a chain-sized maximum: the batch-aware choice between 7 and 15 (a tree narrower
        # than the draft block: the draft KV and the commit use the padded front slots)
        # (exploring every 2nd step per batch size, so that B = 7 surely verifies some steps;
        # acting on any gain: the testbed is host-bound, so the default 3% would keep B = 15)
        "ddtree_b15auto": ServerSpec(target, "ddtree_b15auto", "DDTREE", drafter, 16,
                                     env={"SGLANG_DDTREE_DEBUG": "switch_budgets"}),
        # no speculation among the candidates: requests move between 0-steps (the root alone,
        # plain decoding) and trees of 7 and B nodes every few steps
        "ddtree_b0switch": ServerSpec(target, "ddtree_b0switch", "DDTREE", drafter,
                                      args.budget + 1,
                                      env={"SGLANG_DDTREE_BUDGETS": "0,7",
                                           "SGLANG_DDTREE_DEBUG": "switch_budgets"}),
        "ddtree_nooverlap": ServerSpec(target, "ddtree_nooverlap", "DDTREE", drafter,
                                       args.budget + 1, disable_overlap_schedule=True),
        # SGLang's single masked verify call instead of the tree-attention kernel (the default:
        # every other triton DDTREE arm uses kernels/tree_attention.py)
        "ddtree_single": ServerSpec(target, "ddtree_single", "DDTREE", drafter, args.budget + 1,
                                    env={"SGLANG_DDTREE_DEBUG": "sglang_attention"}),
        "dflash_triton": ServerSpec(target, "dflash_triton", "DFLASH", drafter),
        "plain_triton": ServerSpec(target, "plain_triton"),
        # the reference of the flashinfer arms (same kernels, same bf16 rounding)
        "plain_flashinfer": ServerSpec(target, "plain_flashinfer",
                                       attention_backend="flashinfer"),
        # a gated-delta hybrid target (--testbed testbed_hybrid): implemented, started for its
        # GPU check only
        "ddtree_hybrid": ServerSpec(target, "ddtree_hybrid", "DDTREE", drafter, args.budget + 1,
                                    env={"SGLANG_DDTREE_DEBUG": "unchecked"}),
        # paged KV (16 tokens a page)
        "ddtree_page16": ServerSpec(target, "ddtree_page16", "DDTREE", drafter, args.budget + 1,
                                    page_size=16),
        "plain_page16": ServerSpec(target, "plain_page16", page_size=16),
    }
    # Every arm's server starts at once (fixed KV pool, sleep on idle), so kernel compilation
    # and graph capture overlap; the arms are then checked one at a time.
    unknown = sorted(set(args.arms.split(",")) - set(specs))
    if unknown:
        ap.error(f"--arms: unknown arm(s) {', '.join(unknown)}; accepted: {', '.join(specs)}")
    servers = []
    for name in args.arms.split(","):
        spec = specs[name]
        spec.max_total_tokens, spec.sleep_on_idle, spec.dtype = 200_000, True, dtype
        servers.append(Server(spec, args.out / f"server_{name}.log",
                              env={"SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1"}))
    t_launch = time.time()
    for server in servers:
        server.launch()
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).cuda().eval()
    results = []
    try:
        for server in servers:
            r = check_arm(server, t_launch, prompts, args.max_new_tokens)  # stops the server
            score(model, prompts, r, args.tie_tol)
            results.append(r)
            print(json.dumps(summarize(r)), flush=True)
            write(args.out, results)
    finally:
        for server in servers:
            server.stop()
    for r in results:
        # the reference: plain SGLang with the arm's page size, else on the arm's own attention
        # backend when it ran, else on triton (different kernels round bf16 differently and
        # may split at a near-tie)
        spec = specs[r["arm"]]
        own = f"plain_page{spec.page_size}" if spec.page_size > 1 else \
            f"plain_{spec.attention_backend}"
        plain = next((q for q in results if q["arm"] == own),
                     next((q for q in results if q["arm"].startswith("plain")), None))
        if plain and plain.get("greedy_outputs") and r.get("greedy_outputs"):
            r["plain_reference"] = plain["arm"]
            r["tokens_equal_to_plain"] = sum(
                a == b for x, y in zip(r["greedy_outputs"], plain["greedy_outputs"])
                for a, b in zip(x or [], y or []))
            r["divergences"] = first_divergences(model, prompts, r["greedy_outputs"],
                                                 plain["greedy_outputs"])
    write(args.out, results)
    summary = [summarize(r) for r in results]
    print("\n| arm | healthy after s (all started together) | openai | "
          "greedy not-argmax (>tol) / near-ties / tokens | sampled NLL vs entropy | "
          "mixed ok /24 | accept len | budget: greedy steps | "
          "KV after flush | alive | leak | equal to plain (reference) | first divergences: "
          "float32 gaps |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in summary:
        g, s = r.get("greedy_check", {}), r.get("sampling_check", {})
        print(f"| {r['arm']} | {r.get('healthy_after_s')} | "
              f"{r.get('openai_completions')}/{r.get('openai_chat')} | "
              f"{g.get('not_argmax_beyond_tol')} / {g.get('near_ties')} / {g.get('tokens')} | "
              f"{s.get('mean_nll')} vs {s.get('mean_entropy')} | {r.get('mixed_ok')} | "
              f"{r.get('accept_length')} | {r.get('budget_steps')} | "
              f"{r.get('kv_tokens_after_flush')} | {r.get('alive_at_end')} | "
              f"{r.get('leak_in_log')} | {r.get('tokens_equal_to_plain')} "
              f"({r.get('plain_reference')}) | "
              f"{[d['gap'] for d in r.get('divergences', [])]} | {r.get('error', '')[:200]}")


if __name__ == "__main__":
    main()
