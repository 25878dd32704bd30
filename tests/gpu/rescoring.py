"""References for the GPU checks: the target re-scoring emitted tokens in float32 (teacher
forcing on the server's own prefix, with the request's penalties applied exactly as plain
decoding does), and distribution tests for sampled tokens."""

from __future__ import annotations

import torch

from ddtree_sglang.sampling.penalties import RequestPenalties, reference_node_penalties
from ddtree_sglang.sampling.sample import filtered_probs


@torch.no_grad()
def teacher_force(model, prompts, outputs, tie_tol: float,
                  penalties: RequestPenalties | None = None) -> dict:
    """Per emitted token: is it the target's argmax (after the request's penalties) given its
    actual prefix?  A token within `tie_tol` logits of the argmax counts as a near-tie."""
    dev = next(model.parameters()).device
    n = bad = near = 0
    worst = 0.0
    nll = ent = 0.0
    for p, o in zip(prompts, outputs):
        if not o:
            continue
        ids = torch.tensor([p + o], device=dev)
        logits = model(ids).logits[0, len(p) - 1: len(p) - 1 + len(o)].float()
        if penalties is not None and penalties.active:
            vocab = logits.shape[-1]
            logits = torch.stack([
                reference_node_penalties(logits[i].cpu(), o[:i], vocab, penalties.frequency,
                                         penalties.presence, penalties.repetition,
                                         penalties.min_new_tokens, set(penalties.stop_tokens))
                for i in range(len(o))]).to(dev)
        out = torch.tensor(o, device=dev)
        top = logits.max(-1).values
        emitted = logits.gather(1, out[:, None]).squeeze(1)
        gap = top - emitted
        n += len(o)
        miss = gap > 0
        bad += int((gap > tie_tol).sum())
        near += int((miss & (gap <= tie_tol)).sum())
        worst = max(worst, float(gap.max()))
        logp = torch.log_softmax(logits, -1)
        nll += float(-(logp.gather(1, out[:, None])).sum())
        ent += float(-(logp.exp() * logp).nan_to_num().sum())
    return dict(tokens=n, not_argmax_beyond_tol=bad, near_ties=near, worst_gap=round(worst, 4),
                mean_nll=round(nll / max(n, 1), 4), mean_entropy=round(ent / max(n, 1), 4))


@torch.no_grad()
def first_divergences(model, prompts, outputs, reference, limit: int = 10) -> list[dict]:
    """Where an arm's greedy outputs first leave the reference arm's, prompt by prompt (at
    most `limit`): the position, both tokens, and `gap` = the target's float32 logit of the
    reference's token minus the arm's, on the shared prefix.  A gap within the tie tolerance
    means the two runs split at a near-tie (bf16 rounding), not at a wrong token."""
    dev = next(model.parameters()).device
    found = []
    for i, (p, a, b) in enumerate(zip(prompts, outputs, reference)):
        j = next((k for k, (x, y) in enumerate(zip(a or [], b or [])) if x != y), None)
        if j is None:
            continue
        logits = model(torch.tensor([p + a[:j]], device=dev)).logits[0, -1].float()
        found.append(dict(prompt=i, position=j, token=a[j], reference_token=b[j],
                          gap=round(float(logits[b[j]] - logits[a[j]]), 4)))
        if len(found) == limit:
            break
    return found


def chi_square(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0):
    """Pearson goodness of fit of observed counts to probabilities; bins expected below
    `min_expected` are pooled.  Returns (statistic, degrees of freedom, samples outside the
    support of `probs`)."""
    total = float(counts.sum())
    expected = probs / probs.sum() * total
    outside = int(counts[probs <= 0].sum())
    big = expected >= min_expected
    obs = torch.cat([counts[big], counts[~big].sum().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    return stat, int(keep.sum()) - 1, outside


def chi2_pvalue(stat: float, df: int) -> float:
    """P(chi2_df >= stat), via the regularised upper incomplete gamma function."""
    if df <= 0:
        return float("nan")
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64)))


@torch.no_grad()
def second_token_fit(model, prompt: list[int], pairs: list[tuple[int, int]], temperature: float,
                     top_k: int, top_p: float, sequential: bool = False) -> dict:
    """Goodness of fit of sampled second tokens to the target's filtered distribution given
    (prompt, first token), pooled over first tokens with >= 100 samples.  `sequential=True`
    scores against top-p measured after the top-k renormalisation instead (the rule SGLang does
    not use), which shows whether the test can tell the two apart."""
    dev = next(model.parameters()).device
    groups: dict[int, list[int]] = {}
    for a, b in pairs:
        groups.setdefault(a, []).append(b)
    stat = 0.0
    df = outside = used = 0
    for first, seconds in groups.items():
        if len(seconds) < 100:
            continue
        logits = model(torch.tensor([prompt + [first]], device=dev)).logits[0, -1].float()
        t = torch.tensor([temperature], device=dev)
        if sequential:
            probs = filtered_probs(logits[None], t, torch.tensor([top_k], device=dev))
            keep = filtered_probs(torch.log(probs.clamp_min(1e-30)), torch.ones_like(t),
                                  top_p=torch.tensor([top_p], device=dev))
            probs = keep * (probs > 0)
        else:
            probs = filtered_probs(logits[None], t, torch.tensor([top_k], device=dev),
                                   torch.tensor([top_p], device=dev))
        counts = torch.bincount(torch.tensor(seconds, device=dev),
                                minlength=logits.shape[-1]).float()
        s, d, o = chi_square(counts, probs[0])
        stat, df, outside, used = stat + s, df + d, outside + o, used + len(seconds)
    return dict(samples=used, statistic=round(stat, 2), df=df, outside_support=outside,
                p_value=None if df == 0 else round(chi2_pvalue(stat, df), 4),
                mean_sq_per_df=None if df == 0 else round(stat / df, 3))


@torch.no_grad()
def pick_flat_prompt(model, prompts: list[list[int]], top_k: int, top_p: float) -> list[int]:
    """A prompt prefix whose first token is nearly certain (p >= 0.5 after the filters) and
    whose second token keeps the most tokens under the joint filters and the fewest under
    the sequential rule: where a distribution test has the most power."""
    dev = next(model.parameters()).device
    one = torch.ones(1, device=dev)
    k, p = torch.tensor([top_k], device=dev), torch.tensor([top_p], device=dev)
    best, choice = None, prompts[0][:16]
    for ids in prompts:
        for cut in range(16, min(len(ids), 200), 8):
            pr = ids[:cut]
            p1 = filtered_probs(model(torch.tensor([pr], device=dev)).logits[0, -1:].float(),
                                one, k, p)[0]
            if float(p1.max() / p1.sum()) < 0.5:
                continue
            l2 = model(torch.tensor([pr + [int(p1.argmax())]], device=dev)).logits[0, -1:]
            joint = filtered_probs(l2.float(), one, k, p)[0]
            topk = filtered_probs(l2.float(), one, k)[0]
            seq = filtered_probs(torch.log(topk.clamp_min(1e-30))[None], one, top_p=p)[0]
            score = (int((joint > 0).sum()), -int(((seq > 0) & (topk > 0)).sum()))
            if best is None or score > best:
                best, choice = score, pr
    return choice
