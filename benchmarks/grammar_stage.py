"""What structured output costs the host per decode step, on the CPU: SGLang's Python traversal
of the draft tree, DDTREE's native tree masks, and DDTREE's greedy path walk, over DDTREE's
tree shapes (B = 7 / 15 / 31 / 63) and DFLASH's 16-token chain.

    pip install -e '.[bench]'      # mistral_common: the real 131k vocabulary
    python benchmarks/grammar_stage.py --out benchmarks/results/grammar_stage_cpu_<date>

Per vocabulary (the testbed's 4k tokenizer; a real 131k one, tekken_240911.json from the
mistral_common wheel) and grammar kind (bench/grammars.py), a greedy decode of the kind's
sample output is simulated step by step:
  draft     per position a drafter-like distribution: the sample's next token ranks first
            with probability 0.85^depth (else 2nd-4th), beside alternatives the grammar allows
            there and random ones it mostly does not; DDTREE's builder (tree.build_draft_tree)
            turns it into the top-B tree, chain_tree into DFLASH's chain;
  target    the target's greedy choice is the sample's token; its unmasked top-1 is a
            grammar-forbidden token at 20% of nodes (the walk must then look further down);
  accept    the accepted path is the longest tree path along the sample, plus the bonus token.
Every method's mask rows are checked equal (python vs native) and every walk's choices equal to
the sample along the path, so the timings compare methods that do the same job.
Reported per (vocabulary, kind, tree, method): host microseconds per request per step (median
over steps), mask fills per step and per committed token, and the accept length.  A last table
times a batch's native tree masks serially and on threads (xgrammar releases the GIL).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from ddtree_bench.grammars import KINDS, compile_kind, kind_names  # noqa: E402
from ddtree_sglang.cli import positive_int, positive_int_list  # noqa: E402
from ddtree_sglang.grammar.masks import (TOP_K, PathWalk, allow_all, fill_tree_masks,  # noqa: E402
                                         sample_paths, unpack_bitmask, walk_paths)
from ddtree_sglang.tree.verify_layout import sibling_links  # noqa: E402
from ddtree_sglang.tree.builder import build_draft_tree, chain_tree  # noqa: E402

DEPTH = 15  # a 16-token block: the root and 15 drafted positions
TREES = ("chain16", "B7", "B15", "B31", "B63")


@dataclass
class Vocab:
    name: str
    size: int
    info: object  # xgrammar.TokenizerInfo
    encode: object  # str -> list[int]


def testbed_vocab() -> Vocab:
    import xgrammar as xgr
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(ROOT / "testbed" / "target"))
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok))
    return Vocab("testbed-4k", info.vocab_size, info,
                 lambda s: tok.encode(s, add_special_tokens=False))


def tekken_vocab() -> Vocab:
    """Mistral's 131k tekken vocabulary, shipped inside the mistral_common wheel."""
    from importlib.resources import files

    import xgrammar as xgr
    from mistral_common.tokens.tokenizers.tekken import Tekkenizer

    tk = Tekkenizer.from_file(str(files("mistral_common") / "data" / "tekken_240911.json"))
    pieces = [b"" if i < tk.num_special_tokens else tk.id_to_byte_piece(i)
              for i in range(tk.n_words)]
    info = xgr.TokenizerInfo(pieces, xgr.VocabType.RAW, vocab_size=tk.n_words,
                             stop_token_ids=[tk.eos_id])
    return Vocab("tekken-131k", tk.n_words, info,
                 lambda s: tk.encode(s, bos=False, eos=False))


VOCABS = {"testbed": testbed_vocab, "tekken": tekken_vocab}


def allowed(matcher, vocab: int) -> list[int]:
    mask = allow_all(1, vocab)
    matcher.fill_next_token_bitmask(mask, 0)
    return unpack_bitmask(mask, vocab)[0].nonzero().view(-1).tolist()


def draft_logits(matcher, ref: list[int], vocab: int, rng: random.Random) -> torch.Tensor:
    """[1, DEPTH, V] drafter logits for the positions after the root: the reference token
    first with probability 0.85^d, else 2nd-4th, among grammar-allowed and random
    alternatives.  The matcher is left where it was."""
    logits = torch.full((1, DEPTH, vocab), -20.0)
    advanced = 0
    for d in range(DEPTH):
        if d < len(ref) and not matcher.is_terminated():
            ok = allowed(matcher, vocab)
        else:
            ok = []
        alts = rng.sample(ok, min(4, len(ok))) + [rng.randrange(vocab) for _ in range(4)]
        scores = sorted((rng.uniform(0, 6) for _ in alts), reverse=True)
        for t, s in zip(alts, scores):
            logits[0, d, t] = s
        if d < len(ref):
            rank = 0 if rng.random() < 0.85 ** d else rng.randrange(1, 4)
            top = sorted(logits[0, d].tolist(), reverse=True)
            logits[0, d, ref[d]] = (top[0] + 1.0) if rank == 0 else top[rank] - 0.01
            if not matcher.is_terminated() and matcher.accept_token(ref[d]):
                advanced += 1
    if advanced:
        matcher.rollback(advanced)
    return logits


def tree_links(tree, root: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """first child, next sibling and tokens over root + nodes, and the parents (root = 0)."""
    parents = [-1] + [p + 1 for p in tree.parents[0].tolist()]
    first, nxt = sibling_links(torch.tensor([parents]))
    tokens = torch.tensor([root] + tree.tokens[0].tolist())
    return first[0], nxt[0], tokens, parents


def accepted_path(first: list[int], nxt: list[int], tokens: list[int], ref: list[int]) -> int:
    """How many of the reference tokens the tree holds as a path from the root."""
    node, n = 0, 0
    while n < len(ref):
        c = first[node]
        while c != -1 and tokens[c] != ref[n]:
            c = nxt[c]
        if c == -1:
            break
        node, n = c, n + 1
    return n


def target_top(ref_next: int | None, forbidden: int | None, vocab: int, rng: random.Random):
    """One node's target top-K (values, ids): the reference token the greedy choice, behind a
    forbidden token at 20% of nodes."""
    ids = rng.sample(range(vocab), TOP_K)
    if ref_next is not None:
        ids = [t for t in ids if t != ref_next][:TOP_K - 1]
        front = [forbidden, ref_next] if forbidden is not None and rng.random() < 0.2 \
            else [ref_next]
        ids = (front + [t for t in ids if t not in front])[:TOP_K]
    values = [10.0 - 0.5 * j for j in range(TOP_K)]
    return values, ids


def timed(fn, repeats: int = 3) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e6, out


def simulate(vocab: Vocab, compiled, kind: str, tree_name: str, episodes: int,
             seed: int) -> dict:
    """Every method over the same steps of `episodes` simulated decodes of the kind's sample."""
    import xgrammar as xgr
    from sglang.srt.constrained.xgrammar_backend import XGrammarGrammar
    from sglang.srt.speculative.spec_utils import traverse_tree

    sample = vocab.encode(KINDS[kind].sample)
    rng = random.Random(seed)
    per = {m: [] for m in ("python", "native", "path", "path_wall", "sampled_path")}
    fills = {m: 0 for m in per}
    committed = steps = 0
    for _ in range(episodes):
        m = xgr.GrammarMatcher(compiled)
        pos, root = 0, sample[0]
        assert m.accept_token(root), "the sample must start grammar-valid"
        pos = 1
        while pos < len(sample):
            ref = sample[pos:]
            logits = draft_logits(m, ref, vocab.size, rng)
            tree = (chain_tree(logits) if tree_name == "chain16"
                    else build_draft_tree(logits, int(tree_name[1:])))
            first, nxt, tokens, parents = tree_links(tree, root)
            width = tokens.numel()
            first_l, nxt_l, tok_l = first.tolist(), nxt.tolist(), tokens.tolist()
            n_acc = accepted_path(first_l, nxt_l, tok_l, ref)
            # python: SGLang's traversal (what DFLASH and EAGLE run)
            grammar = XGrammarGrammar(m, vocab.size, compiled, None)
            py_rows = allow_all(width, vocab.size)
            us, _ = timed(lambda: traverse_tree(first, nxt, tokens, grammar, py_rows,
                                                vocab_size=vocab.size))
            per["python"].append(us)
            native_rows = allow_all(width, vocab.size)
            us, _ = timed(lambda: fill_tree_masks(m, first, nxt, tokens, native_rows))
            per["native"].append(us)
            assert torch.equal(native_rows, py_rows), (kind, tree_name)
            filled = int((native_rows != -1).any(-1).sum())
            fills["python"] += filled
            fills["native"] += filled
            # path: the greedy walk along the target's choices (the sample)
            path_nodes, node = [0], 0
            for j in range(n_acc):
                c = first_l[node]
                while tok_l[c] != ref[j]:
                    c = nxt_l[c]
                path_nodes.append(c)
                node = c
            on_path = {c: j for j, c in enumerate(path_nodes)}
            values, ids = [], []
            for c in range(width):
                j = on_path.get(c)
                want = ref[j] if j is not None and j < len(ref) else None
                bad = _forbidden(m, ref[:j], vocab.size, rng) if want is not None else None
                v, i = target_top(want, bad, vocab.size, rng)
                values.append(v)
                ids.append(i)
            target_logits = torch.zeros(width, vocab.size)

            def walk():
                w = PathWalk(m, first_l, nxt_l, tok_l)
                try:
                    stats = walk_paths(target_logits, [0], [w], width, vocab.size, [values],
                                       [ids], [[0] * width], False)
                finally:
                    if not w.done:
                        w.finish()
                return w, stats

            # the walk's grammar work (checks and mask fills) as the server times it (the
            # masked argmax of a fallback is a GPU op there), and its wall time on this CPU
            host_us = wall_us = float("inf")
            for _ in range(3):
                t0 = time.perf_counter()
                w, stats = walk()
                wall_us = min(wall_us, (time.perf_counter() - t0) * 1e6)
                host_us = min(host_us, w.host_s * 1e6)
            per["path"].append(host_us)
            per["path_wall"].append(wall_us)
            fills["path"] += stats[1]
            want_path = ref[:n_acc + 1]
            assert [w.choices.get(c) for c in path_nodes][:len(want_path)] == want_path, \
                (kind, tree_name)
            # sampled: a mask per visited node (sample_paths), the draws being the sample's
            # tokens; its grammar work is the fills
            depth_of = {c: j for j, c in enumerate(path_nodes)}

            def draw(sub, req_rows, nodes):  # past the sample's end: an allowed token
                return torch.tensor([ref[depth_of[j]] if depth_of[j] < len(ref) else
                                     int(sub[i].argmax()) for i, j in enumerate(nodes)])

            sampled_us = float("inf")
            for _ in range(3):
                sw = PathWalk(m, first_l, nxt_l, tok_l)
                rounds = sample_paths(torch.zeros(width, vocab.size), [0], [sw], width,
                                      vocab.size, draw)
                sampled_us = min(sampled_us, sw.host_s * 1e6)
            assert [sw.choices.get(c) for c in path_nodes][:len(want_path)] == want_path
            per["sampled_path"].append(sampled_us)
            fills["sampled_path"] += rounds
            step_tokens = ref[:n_acc + 1]
            for t in step_tokens:
                if not m.is_terminated():
                    assert m.accept_token(t)
            committed += len(step_tokens)
            steps += 1
            root = step_tokens[-1]
            pos += len(step_tokens)
    out = dict(steps=steps, accept_length=round(committed / steps, 2), methods={
        meth: dict(us_per_step=round(statistics.median(v), 1),
                   fills_per_step=round(fills[meth] / steps, 2),
                   fills_per_token=round(fills[meth] / committed, 2))
        for meth, v in per.items()})
    return out


def _forbidden(matcher, prefix: list[int], vocab: int, rng: random.Random) -> int | None:
    """A token the grammar forbids after `prefix` (None if 64 random tries find none)."""
    for _ in range(64):
        t = rng.randrange(vocab)
        if not _allows(matcher, prefix, t):
            return t
    return None


def _allows(matcher, prefix: list[int], token: int) -> bool:
    """Whether the grammar allows `token` after `prefix` (the matcher restored)."""
    n = 0
    for t in prefix:
        if matcher.is_terminated() or not matcher.accept_token(t):
            break
        n += 1
    ok = not matcher.is_terminated() and matcher.accept_token(token)
    n += ok
    if n:
        matcher.rollback(n)
    return ok


def threads_table(vocab: Vocab, compiled, kind: str, batch: int, workers: int,
                  seed: int) -> float:
    """Native tree masks (B = 31) for `batch` requests: µs per request, serial or on threads."""
    import xgrammar as xgr

    sample = vocab.encode(KINDS[kind].sample)
    rng = random.Random(seed)
    jobs = []
    for _ in range(batch):
        m = xgr.GrammarMatcher(compiled)
        cut = rng.randrange(1, max(2, len(sample) // 2))
        for t in sample[:cut]:
            m.accept_token(t)
        logits = draft_logits(m, sample[cut:], vocab.size, rng)
        first, nxt, tokens, _ = tree_links(build_draft_tree(logits, 31), sample[cut - 1])
        jobs.append((m, first, nxt, tokens, allow_all(tokens.numel(), vocab.size)))

    def one(job):
        fill_tree_masks(*job)

    def all_jobs():
        if workers == 1:
            for job in jobs:
                one(job)
        else:
            list(pool.map(one, jobs))

    with ThreadPoolExecutor(max_workers=workers) as pool:
        us, _ = timed(all_jobs, repeats=5)
    return round(us / batch, 1)


def goal_lines(rows: list[dict], tree: str = "B31") -> list[str]:
    """The issue's CPU goal per kind at `tree` with the largest vocabulary: DDTREE's host time
    (greedy: the cheaper of tree masks and the top-K walk; sampled: of tree masks and the
    sampled path masks; `auto` picks between them) against 1/5 of SGLang's traversal over the
    same tree and over DFLASH's chain."""
    vocab = rows[-1]["vocab"] if rows else ""
    at = {(r["kind"], r["tree"]): r["methods"] for r in rows if r["vocab"] == vocab}
    lines = ["", f"Goal at {tree}, {vocab}: DDTREE's host µs per request per step <= 1/5 of the "
             f"Python traversal over the same tree and <= that traversal over chain16.", "",
             "| kind | DDTREE greedy (min of native, path) | DDTREE sampled (min of native, "
             "sampled path) | python "
             f"{tree} / 5 | python chain16 | greedy meets both | sampled meets both |",
             "|---|---|---|---|---|---|---|"]
    for kind in dict.fromkeys(k for k, _ in at):
        m, chain = at.get((kind, tree)), at.get((kind, "chain16"))
        if not m or not chain:
            continue
        greedy = min(m["native"]["us_per_step"], m["path"]["us_per_step"])
        sampled = min(m["native"]["us_per_step"], m["sampled_path"]["us_per_step"])
        fifth, ch = m["python"]["us_per_step"] / 5, chain["python"]["us_per_step"]
        lines.append(f"| {kind} | {greedy:,} | {sampled:,} | {fifth:,.1f} | {ch:,} | "
                     f"{'yes' if greedy <= min(fifth, ch) else 'no'} | "
                     f"{'yes' if sampled <= min(fifth, ch) else 'no'} |")
    return lines


def markdown(res: dict) -> str:
    m = res["meta"]
    lines = [f"# Grammar stage on the CPU, {m['date']}", "",
             f"Command: `{m['command']}` ({m['cpu']}, {m['cores']} cores, xgrammar "
             f"{m['xgrammar']}). Host µs per request per decode step (median over steps), "
             "mask fills per step and per committed token; accept = tokens committed per step.",
             "path µs: the walk's grammar work (checks and mask fills), as the server times "
             "it; path wall µs adds the fallback's masked argmax, on this CPU (a GPU op in the "
             "server).", "",
             "sampled path µs: a mask per visited node (sampled and logprob requests).", "",
             "| vocabulary | kind | tree | accept | python µs | native µs | path µs | "
             "path wall µs | sampled path µs | fills/token python = native | fills/token path "
             "| fills/token sampled path |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        mm = r["methods"]
        lines.append(f"| {r['vocab']} | {r['kind']} | {r['tree']} | {r['accept_length']} | "
                     f"{mm['python']['us_per_step']:,} | {mm['native']['us_per_step']:,} | "
                     f"{mm['path']['us_per_step']:,} | {mm['path_wall']['us_per_step']:,} | "
                     f"{mm['sampled_path']['us_per_step']:,} | "
                     f"{mm['native']['fills_per_token']} | {mm['path']['fills_per_token']} | "
                     f"{mm['sampled_path']['fills_per_token']} |")
    lines += goal_lines(res["rows"])
    lines += ["", "Native tree masks (B = 31) for a batch of requests: µs per request, "
              "serial or on threads.", "", "| vocabulary | kind | batch | " +
              " | ".join(f"{w} thread(s)" for w in m["workers"]) + " |",
              "|---|---|---|" + "---|" * len(m["workers"])]
    for r in res["threads"]:
        lines.append(f"| {r['vocab']} | {r['kind']} | {r['batch']} | " +
                     " | ".join(f"{r['us'][str(w)]:,}" for w in m["workers"]) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--vocabs", default="testbed,tekken", help="comma list of testbed, tekken")
    ap.add_argument("--kinds", default="json,json_bounded,regex,ebnf,tool_call")
    ap.add_argument("--trees", default=",".join(TREES), help="comma list of " + ", ".join(TREES))
    ap.add_argument("--episodes", type=positive_int, default=6,
                    help="simulated decodes per cell")
    ap.add_argument("--batches", type=positive_int_list, default=[16, 64])
    ap.add_argument("--workers", type=positive_int_list, default=[1, 2, 4])
    args = ap.parse_args()
    vocabs = [v for v in args.vocabs.split(",") if v]
    trees = [t for t in args.trees.split(",") if t]
    for bad, accepted, what in ((set(vocabs) - set(VOCABS), VOCABS, "vocabulary"),
                                (set(trees) - set(TREES), TREES, "tree")):
        if bad:
            ap.error(f"unknown {what} {', '.join(sorted(bad))}; accepted: {', '.join(accepted)}")
    try:
        kinds = [k for k in kind_names(args.kinds) if k != "none"]
    except ValueError as exc:
        ap.error(str(exc))
    import os
    import platform
    from importlib.metadata import version

    import xgrammar as xgr

    workers = args.workers
    res = dict(meta=dict(date=time.strftime("%Y-%m-%d"), command="python " + " ".join(sys.argv),
                         cpu=platform.processor() or platform.machine(),
                         cores=os.cpu_count(), xgrammar=version("xgrammar"),
                         workers=workers), rows=[], threads=[])
    args.out.mkdir(parents=True, exist_ok=True)
    for v in vocabs:
        vocab = VOCABS[v]()
        compiler = xgr.GrammarCompiler(vocab.info, max_threads=1)
        for kind in kinds:
            compiled = compile_kind(compiler, kind)
            for t in trees:
                row = dict(vocab=vocab.name, kind=kind, tree=t,
                           **simulate(vocab, compiled, kind, t, args.episodes, seed=1))
                res["rows"].append(row)
                print(json.dumps(row), flush=True)
            for b in args.batches:
                res["threads"].append(dict(vocab=vocab.name, kind=kind, batch=b, us={
                    str(w): threads_table(vocab, compiled, kind, b, w, seed=2) for w in workers}))
                print(json.dumps(res["threads"][-1]), flush=True)
            (args.out / "grammar_stage.json").write_text(json.dumps(res, indent=1))
    md = markdown(res)
    (args.out / "grammar_stage.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
