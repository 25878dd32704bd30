"""Measure the testbed pair's acceptance (tau, bonus included) with the reference loop.

    python scripts/eval_testbed.py --testbed testbed --out benchmarks/results/testbed_acceptance.json

For temperature 0 and 1: the DFlash chain and DDTree at several budgets, on the held-out prompts.
Greedy runs are also checked against autoregressive greedy output (lossless).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import date
from pathlib import Path

import torch

from ddtree_sglang.cli import CliError, Parser, positive_int, positive_int_list, require_cuda, run
from ddtree_sglang.reference.testbed import TestbedError, load_testbed
from ddtree_sglang.sampling.sample import SamplingParams


def main() -> None:
    ap = Parser(prog="eval_testbed", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--testbed", type=Path, default=Path("testbed"))
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/testbed_acceptance.json"))
    ap.add_argument("--budgets", type=positive_int_list, default=[8, 16, 32, 64, 128])
    ap.add_argument("--prompts", type=positive_int, default=16)
    ap.add_argument("--max-new-tokens", type=positive_int, default=96)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    require_cuda(args.device)
    try:
        tb = load_testbed(args.testbed, device=args.device)
    except TestbedError as exc:
        raise CliError(f"--testbed: {exc}") from None
    rows = tb.prompts[: args.prompts]
    encoded = [tb.encode(r) for r in rows]
    spec = tb.speculator
    results, mismatches = [], 0
    ar_out = [spec.generate(p, args.max_new_tokens, mode="ar").tokens for p in encoded]
    arms = [("chain", 0)] + [("ddtree", b) for b in args.budgets]
    for temp in (0.0, 1.0):
        sp = SamplingParams(temperature=temp)
        for mode, budget in arms:
            t0 = time.perf_counter()
            lens, toks = [], 0
            for i, p in enumerate(encoded):
                res = spec.generate(p, args.max_new_tokens, mode=mode, budget=max(budget, 1),
                                    sampling=sp, seed=i)
                lens += res.accept_lens
                toks += len(res.tokens)
                if temp == 0.0 and res.tokens != ar_out[i]:
                    mismatches += 1
            tau = sum(lens) / max(1, len(lens))
            row = dict(temperature=temp, mode=mode, budget=budget if mode == "ddtree" else None,
                       tau=round(tau, 3), steps=len(lens), tokens=toks,
                       seconds=round(time.perf_counter() - t0, 1))
            results.append(row)
            print(json.dumps(row), flush=True)
    meta = dict(date=str(date.today()), device=(torch.cuda.get_device_name() if args.device == "cuda"
                                                else "cpu"),
                prompts=len(encoded), max_new_tokens=args.max_new_tokens,
                greedy_mismatches_vs_ar=mismatches,
                command=f"python scripts/eval_testbed.py --testbed {args.testbed} "
                        f"--budgets {','.join(map(str, args.budgets))} "
                        f"--prompts {args.prompts} --max-new-tokens {args.max_new_tokens}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(meta=meta, rows=results), indent=1))
    print(json.dumps(meta))


if __name__ == "__main__":
    sys.exit(run(main, "eval_testbed"))
