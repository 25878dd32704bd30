"""Does a testbed drafter memorise its training data?  Top-1 accuracy of the drafter per block
position on the target's own continuations of prompts cut from training files vs held-out files
(same corpus split as scripts/train_testbed.py).  A large gap means memorisation.

    python scripts/drafter_accuracy.py --testbed testbed --corpus stdlib --seqs 128 \
        --out benchmarks/results/testbed_drafter_accuracy_cpu.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

import train_testbed as tt  # noqa: E402  (scripts/ is on sys.path when run as a script)
from testbed_drafter import drafter_accuracy, log  # noqa: E402

from ddtree_sglang.cli import CliError, Parser, positive_int, require_cuda, run  # noqa: E402


def main() -> None:
    ap = Parser(prog="drafter_accuracy", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--testbed", type=Path, default=Path("testbed"))
    ap.add_argument("--corpus", choices=["stdlib", "all"], default="stdlib")
    ap.add_argument("--seqs", type=positive_int, default=128, help="continuations per side")
    ap.add_argument("--files", type=positive_int, default=200, help="files per side to cut prompts from")
    ap.add_argument("--seq-len", type=positive_int, default=tt.SEQ,
                    help=f"prompt (64 tokens) plus continuation (default {tt.SEQ}, as trained)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.seq_len < 96:
        ap.error(f"--seq-len must be at least 96 (a 64-token prompt and two blocks); "
                 f"got {args.seq_len}")
    require_cuda(args.device)
    for need in ("target/config.json", "drafter/config.json"):
        if not (args.testbed / need).is_file():
            raise CliError(f"--testbed {args.testbed}: {need} is missing (a testbed holds "
                           f"target/ and drafter/)")
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    from ddtree_sglang.reference.drafter import DFlashDrafter

    tok = AutoTokenizer.from_pretrained(args.testbed / "target")
    model = Qwen3ForCausalLM.from_pretrained(args.testbed / "target", dtype=torch.float32,
                                             attn_implementation="sdpa").to(args.device).eval()
    drafter = DFlashDrafter.from_pretrained(args.testbed / "drafter", dtype=torch.float32,
                                            device=args.device)
    train_files, held_files = tt.corpus_files(args.corpus)
    res = dict(date=time.strftime("%Y-%m-%d"), device=args.device, testbed=str(args.testbed),
               command="python scripts/drafter_accuracy.py " + " ".join(
                   f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None))
    for side, files in (("train_files", train_files), ("held_out_files", held_files)):
        tokens = tt.encode_files(tok, files[: args.files])
        seqs = tt.target_continuations(model, tokens, args.seqs, 64, args.seq_len - 64, args.device,
                                       batch=64, seed=9)
        acc = drafter_accuracy(model, drafter, seqs, args.device)
        res[side] = [round(a, 3) for a in acc]
        log(f"{side}: top-1 @1 {acc[0]:.2f} @2 {acc[1]:.2f} @4 {acc[3]:.2f} @8 {acc[7]:.2f}")
    if args.out:
        args.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    sys.exit(run(main, "drafter_accuracy"))
