"""Greedy outputs of each arm against the no-speculation arm, so a speedup never hides a
correctness loss.  Where an arm's output parts from the reference, the reference server scores
the prefix and says whether the arm's token was a near-tie for the target there."""

from __future__ import annotations

from ddtree_bench.server import post_json


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def top_logprobs(url: str, prefix: list[int], k: int = 5) -> dict[int, float]:
    """The target's top-k next-token logprobs after `prefix` (from a no-speculation server)."""
    out = post_json(url + "/generate", {
        "input_ids": prefix, "return_logprob": True, "top_logprobs_num": k,
        "logprob_start_len": len(prefix) - 1,
        "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}})
    tops = (out.get("meta_info") or {}).get("output_top_logprobs") or [[]]
    return {int(tok): float(lp) for lp, tok, *_ in tops[0]}


def compare_to_reference(prompts: list[list[int]], arm_outputs: dict[int, list[int]],
                         ref_outputs: dict[int, list[int]], ref_url: str | None,
                         tie_tol: float = 0.05) -> dict:
    """Counts of identical outputs; for each divergence, the logprob gap of the arm's token."""
    same, diverged, ties, real = 0, 0, 0, []
    for idx, out in arm_outputs.items():
        ref = ref_outputs.get(idx)
        if ref is None:
            continue
        pos = first_divergence(out, ref)
        if pos is None:
            same += 1
            continue
        diverged += 1
        if ref_url is None or pos >= min(len(out), len(ref)):
            continue
        lps = top_logprobs(ref_url, prompts[idx] + ref[:pos])
        best = max(lps.values()) if lps else None
        mine = lps.get(out[pos])
        gap = None if best is None or mine is None else best - mine
        if gap is not None and gap <= tie_tol:
            ties += 1
        else:
            real.append(dict(prompt=idx, position=pos, arm_token=out[pos], ref_token=ref[pos],
                             logprob_gap=gap))
    return dict(identical=same, diverged=diverged, diverged_at_near_tie=ties,
                diverged_not_tie=len(real), examples=real[:5], tie_tol=tie_tol)
