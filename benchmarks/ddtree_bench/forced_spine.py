"""The forced spine (grammar_forcing.py) end to end on the CPU: the reference loop on the testbed
pair with a grammar, the same requests with and without the spine, against plain masked
autoregressive decoding.

For each grammar kind and budget: committed tokens per verify step (the accept length), the
spine's tokens proposed and accepted, how often the target refused a spine's first token (a
tokenization it would not emit), whether every output equals masked AR greedy, and for sampled
requests the accept length with and without the spine.  `spine_cost` times the spine's host
work per step along a kind's sample output with any vocabulary (the real 131k one in
benchmarks/forced_spine.py).
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

from ddtree_bench.grammars import compile_kind

def testbed_grammars(pair, kinds: list[str]) -> tuple[Callable[[str], object], int]:
    """(kind -> a fresh xgrammar matcher for the testbed tokenizer, vocabulary size)."""
    import xgrammar as xgr

    tok = pair.tokenizer
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok))
    compiler = xgr.GrammarCompiler(info)
    compiled = {k: compile_kind(compiler, k) for k in kinds}
    return (lambda k: xgr.GrammarMatcher(compiled[k])), info.vocab_size


VARIANTS = {"plain": dict(), "forced": dict(force=True),
            "forced_children": dict(force=True, force_children=True)}


def run_kind(pair, matcher_of, vocab: int, kind: str, budget: int, prompts: int,
             max_new_tokens: int, temperature: float = 0.0,
             variants: tuple[str, ...] = ("plain", "forced")) -> dict:
    """Every prompt without the spine and with each variant of VARIANTS (and masked AR when
    greedy): accept length per variant (`accept_<variant>`), the spine's counts, and whether
    every variant committed the same tokens as the reference."""
    from ddtree_sglang.reference.constrained import ConstrainedRequest
    from ddtree_sglang.sampling.sample import SamplingParams

    spec = pair.speculator
    encode = lambda s: pair.tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    sampling = SamplingParams(temperature=temperature, seed=7 if temperature else None)
    row: dict = dict(kind=kind, budget=budget, temperature=temperature)
    outs: dict = {}
    for variant in variants:
        steps = committed = 0
        stats = None
        tokens = []
        for p in pair.prompts[:prompts]:
            req = ConstrainedRequest(matcher_of(kind), vocab, encode, **VARIANTS[variant])
            res = spec.generate(pair.encode(p), max_new_tokens, mode="ddtree", budget=budget,
                                sampling=sampling, grammar=req)
            steps += len(res.accept_lens)
            committed += sum(res.accept_lens)
            tokens.append(res.tokens)
            stats = req.stats if stats is None else stats + req.stats
        row[f"accept_{variant}"] = round(committed / max(steps, 1), 3)
        outs[variant] = tokens
        if variant == "forced":
            row.update(spine_steps=stats.steps, spine_proposed=stats.proposed,
                       spine_accepted=stats.accepted, spine_refused_first=stats.refused_first)
    if "forced" in outs:
        row["gain"] = round(row["accept_forced"] / row["accept_plain"], 3)
    if temperature == 0:
        ar = [spec.generate(pair.encode(p), max_new_tokens, mode="ar",
                            grammar=ConstrainedRequest(matcher_of(kind), vocab)).tokens
              for p in pair.prompts[:prompts]]
        row["equal_to_masked_ar"] = all(out == ar for out in outs.values())
    else:  # seeded draws are a function of (seed, position): the same output either way
        row["forced_equals_unforced"] = all(out == outs["plain"] for out in outs.values())
    return row


def spine_cost(matcher, sample: list[int], encode: Callable[[str], list[int]],
               depth: int = 15) -> dict:
    """Host µs per decode step of the spine (forced_tokens from the committed state) along a
    sample output, one step per token position, and the share of steps with a spine."""
    from ddtree_sglang.grammar.forcing import forced_tokens

    times, lengths = [], []
    for token in sample:
        t0 = time.perf_counter()
        spine = forced_tokens(matcher, encode, depth)
        times.append((time.perf_counter() - t0) * 1e6)
        lengths.append(len(spine))
        if not matcher.accept_token(token):
            break
    with_spine = [n for n in lengths if n]
    return dict(us_median=round(statistics.median(times), 1), us_max=round(max(times), 1),
                steps=len(times), with_spine=round(len(with_spine) / len(times), 3),
                spine_len=round(statistics.mean(with_spine), 2) if with_spine else 0.0)
