import pytest
import torch

from ddtree_sglang.reference.drafter import DFlashDrafter
from ddtree_sglang.reference.loop import ReferenceSpeculator
from ddtree_sglang.reference.tiny import tiny_pair
from ddtree_sglang.sampling.sample import SamplingParams


@pytest.fixture(scope="module")
def spec():
    target, drafter = tiny_pair()
    return ReferenceSpeculator(target, drafter)


PROMPTS = [[5, 17, 33, 8, 9], [40, 41, 42], list(range(10, 30))]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_chain_and_ddtree_equal_autoregressive(spec, prompt):
    ar = spec.generate(prompt, 40, mode="ar")
    chain = spec.generate(prompt, 40, mode="chain")
    for budget in (1, 4, 16, 48):
        tree = spec.generate(prompt, 40, mode="ddtree", budget=budget)
        assert tree.tokens == ar.tokens, f"DDTree(B={budget}) differs from greedy"
        assert sum(tree.accept_lens) + 1 >= len(tree.tokens)
    assert chain.tokens == ar.tokens
    assert len(ar.tokens) == 40 and ar.target_forwards == 39


def test_perfect_drafter_is_fully_accepted(spec):
    """A drafter whose logits are the target's own greedy continuation accepts whole blocks."""
    prompt = PROMPTS[0]
    ar = spec.generate(prompt, 30, mode="ar")

    class Oracle(torch.nn.Module):
        pass

    real = spec.draft_logits
    cursor = {"i": 0}

    def oracle_logits(feats, bonus):
        # committed = prompt + tokens so far; the bonus is ar.tokens[k]
        k = feats.shape[0] - len(prompt)
        future = ar.tokens[k + 1: k + 1 + spec.cfg.draft_depth]
        out = torch.full((1, spec.cfg.draft_depth, spec.cfg.vocab_size), -10.0)
        for d, t in enumerate(future):
            out[0, d, t] = 10.0
        cursor["i"] += 1
        return out

    spec.draft_logits = oracle_logits
    try:
        res = spec.generate(prompt, 30, mode="ddtree", budget=8)
    finally:
        spec.draft_logits = real
    assert res.tokens == ar.tokens
    assert max(res.accept_lens) == spec.cfg.block_size  # L draft tokens + bonus


def test_sampling_runs_and_is_seeded(spec):
    p = SamplingParams(temperature=1.0, top_p=0.9, top_k=20)
    a = spec.generate(PROMPTS[1], 25, mode="ddtree", budget=8, sampling=p, seed=3)
    b = spec.generate(PROMPTS[1], 25, mode="ddtree", budget=8, sampling=p, seed=3)
    assert a.tokens == b.tokens and len(a.tokens) == 25


def test_drafter_checkpoint_round_trip(tmp_path, spec):
    spec.drafter.save_pretrained(tmp_path, dtype=torch.float32)
    loaded = DFlashDrafter.from_pretrained(tmp_path)
    assert loaded.config == spec.drafter.config
    feats = torch.randn(1, 6, 2 * loaded.config.hidden_size)
    emb = torch.randn(1, loaded.config.block_size, loaded.config.hidden_size)
    pos = torch.arange(6 + loaded.config.block_size)[None]
    assert torch.allclose(loaded(feats, emb, pos), spec.drafter(feats, emb, pos), atol=1e-6)


def test_bad_inputs(spec):
    with pytest.raises(ValueError, match="mode must be one of"):
        spec.generate([1, 2], 4, mode="beam")
    with pytest.raises(ValueError, match="at least one token"):
        spec.generate([], 4)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(temperature=1.0, top_p=0.0)


def test_batch_aware_budget_is_lossless_and_recorded(spec):
    """A budget chosen per step (truncating one tree) keeps greedy output equal to AR."""
    from ddtree_sglang.budget.controller import BudgetController, StepCosts

    depth = spec.cfg.block_size - 1
    prompt = PROMPTS[0]
    ar = spec.generate(prompt, 40, mode="ar")
    for costs in ({1: {1: 1.0, 4: 1.0, 16: 1.0}}, {1: {1: 1.0, 4: 3.0, 16: 9.0}}):
        ctl = BudgetController([1, 4, 16], StepCosts(costs), depth)
        auto = spec.generate(prompt, 40, mode="ddtree", budget=ctl)
        assert auto.tokens == ar.tokens
        assert len(auto.budgets) == len(auto.accept_lens)
        assert set(auto.budgets) <= {1, 4, 16}
    assert spec.generate(prompt, 10, mode="ddtree", budget=4).budgets[0] == 4


class Alternating:
    """A budget controller stand-in that switches every step between no speculation (0) and
    tree budgets, so one request moves between 0-steps and tree steps many times."""

    def __init__(self, budgets: list[int]) -> None:
        self.budgets, self.calls = budgets, 0

    def calibrated(self, depth_probs):
        return depth_probs.sum(-1).mean(0)

    def choose(self, bs, expected):
        self.calls += 1
        return self.budgets[self.calls % len(self.budgets)]

    def observe(self, *args):
        return None


def test_steps_without_speculation_keep_outputs_exact_across_switches(spec):
    """Budget 0 (no speculation: the root alone, one token) between tree steps: greedy output
    equals autoregressive decoding, and seeded sampled output equals the same request decoded
    with trees only (every draw is a function of the seed and the position)."""
    from ddtree_sglang.budget.controller import BudgetController

    prompt = PROMPTS[1]
    ar = spec.generate(prompt, 30, mode="ar")
    switching = spec.generate(prompt, 30, mode="ddtree", budget=Alternating([0, 4, 0, 16]))
    assert switching.tokens == ar.tokens
    assert 0 in switching.budgets and 16 in switching.budgets
    assert all(n == 1 for b, n in zip(switching.budgets, switching.accept_lens) if b == 0)
    sampling = SamplingParams(temperature=1.0, seed=11)
    trees = spec.generate(prompt, 30, mode="ddtree", budget=8, sampling=sampling)
    mixed = spec.generate(prompt, 30, mode="ddtree", budget=Alternating([0, 8]),
                          sampling=sampling)
    assert mixed.tokens == trees.tokens
    assert isinstance(BudgetController([0, 4], _costs(), 3), BudgetController)


def _costs():
    from ddtree_sglang.budget.controller import StepCosts

    return StepCosts({1: {0: 1.0, 4: 1.0}})
