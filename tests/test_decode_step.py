"""The DDTREE decode step (sglang_plugin/decode_step.py) on the CPU, built from its parts with
SGLang fakes: each stage's logic against a reference, the grammar traversal over DDTREE's
tree, and the committed tokens' logprobs."""
import functools
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("sglang")

from ddtree_sglang.tree.stages import (StepCommit, accept_stage, tree_stage,  # noqa: E402
                                   unpack_tree_stage)
from ddtree_sglang.kernels.choice import Kernels  # noqa: E402
from ddtree_sglang.sglang_plugin import sglang_api as sg, decode_step as wmod  # noqa: E402
from ddtree_sglang.sglang_plugin.draft_input import make_draft_input  # noqa: E402
from ddtree_sglang.sglang_plugin.grammar_stage import GrammarStep, MaskCosts, Walks  # noqa: E402
from ddtree_sglang.sglang_plugin.model_io import draft_logits  # noqa: E402
from ddtree_sglang.sglang_plugin.request_state import PenaltyState  # noqa: E402
from ddtree_sglang.sglang_plugin.settings import DDTreeSettings  # noqa: E402
from ddtree_sglang.sglang_plugin.step_records import (DraftedTree, StepPlan,  # noqa: E402
                                                      Verified)
from ddtree_sglang.sglang_plugin.graphed_stages import GraphedStages  # noqa: E402
from ddtree_sglang.tree.builder import build_draft_tree  # noqa: E402
from ddtree_sglang.tree.acceptance import SimulatedAcceptance  # noqa: E402

V, H, BLOCK, B = 40, 8, 4, 8  # vocab, hidden, draft block (depth 3), budget
ROW = 64  # slots of a request's req_to_token row


class FakeIO:
    """The step's model I/O (model_io.ModelIO) without models: records what the step asks."""

    def __init__(self) -> None:
        self.target_runner = SimpleNamespace(attn_backend="configured backend",
                                             decode_cuda_graph_runner="configured graphs")
        self.calls: list = []
        self.verify_out = None
        self.hidden = None  # the drafter states draft_block returns (random where None)

    def max_step_seq_len(self) -> int:
        return ROW - (B + 1)

    def draft_block(self, batch, draft_input):
        self.calls.append(("draft", draft_input))
        hidden = self.hidden if self.hidden is not None else torch.randn(
            len(batch.seq_lens), BLOCK, H)
        return hidden, False  # the pass ran eagerly: the step runs the tree stage itself

    def target_verify(self, batch, draft_input, layout, mask_positions=None, mask_buffer=None):
        self.calls.append(("verify", (self.target_runner.attn_backend,
                                      self.target_runner.decode_cuda_graph_runner)))
        self.mask_buffer = mask_buffer
        slots = "slots" if layout is None else 100 + torch.arange(layout.draft_tokens.numel())
        return self.verify_out, "verify batch", True, slots

    def move_accepted_kv(self, batch, step, slots):
        self.calls.append(("move", slots.kv_target))

    def append_committed_features(self, logits_output, step, slots):
        self.calls.append(("features", slots.draft_slots))

    def next_draft_input(self, bonus_tokens, seq_lens):
        return make_draft_input(bonus_tokens, seq_lens)

    def commit_recurrent_state(self, verify_backend, batch, step, width):
        self.calls.append(("recurrent", verify_backend))


LM_HEAD = SimpleNamespace(weight=torch.randn(V, H, generator=torch.Generator().manual_seed(0)))


def make_step(budget: int = B, serving_budget=None, clock=None,
              env: dict | None = None) -> wmod.DecodeStep:
    """A DecodeStep from its parts: settings, vocabulary, fake I/O, eager tree stages."""
    settings = DDTreeSettings.from_values(budget, BLOCK, environ=env or {})
    stages = GraphedStages(Kernels(), budget, BLOCK - 1, BLOCK,
                           functools.partial(draft_logits, LM_HEAD, vocab_size=V),
                           settings.budgets, max_bs=6, hidden_size=H, graphed=False)
    return wmod.DecodeStep(settings, V, FakeIO(), stages, PenaltyState(6, V, "cpu"),
                           MaskCosts(), serving_budget, clock)


def plain_request() -> SimpleNamespace:
    return SimpleNamespace(sampling_params=SimpleNamespace(
        frequency_penalty=0.0, presence_penalty=0.0, repetition_penalty=1.0, min_new_tokens=0,
        stop_token_ids=None, sampling_seed=None))


def make_batch(bs: int = 2, seq_lens=(5, 9), **fields) -> SimpleNamespace:
    seq = torch.tensor(seq_lens[:bs], dtype=torch.int64)
    spec = make_draft_input(torch.tensor([3, 7][:bs]), seq)
    base = dict(seq_lens=seq, spec_info=spec, has_grammar=False,
                reqs=[plain_request() for _ in range(bs)], sampling_info=None,
                req_pool_indices=torch.arange(bs), return_logprob=False,
                top_logprobs_nums=None, token_ids_logprobs=None)
    return SimpleNamespace(**{**base, **fields})


def tree_from(w, batch, plan: StepPlan, hidden: torch.Tensor, barrier=None) -> DraftedTree:
    """The draft-and-tree stage over drafter states `hidden` (the fake I/O returns them)."""
    w.io.hidden = hidden
    return w.draft_tree(batch, plan, barrier)


def drafted(w, batch, plan: StepPlan) -> DraftedTree:
    hidden = torch.randn(plan.bs, BLOCK, H, generator=torch.Generator().manual_seed(1))
    return tree_from(w, batch, plan, hidden)


def plan_of(batch, budget: int = B) -> StepPlan:
    return StepPlan(len(batch.seq_lens), budget, batch.spec_info)


def test_plan_clamps_finished_rows_and_takes_the_budget():
    w = make_step()
    batch = make_batch(seq_lens=(5, 60))  # 60 + 9 verify tokens would pass the 64-slot row
    relay = batch.spec_info
    plan = w.begin_step(batch)
    assert plan == StepPlan(bs=2, budget=B, draft_input=relay) and plan.width == B + 1
    assert batch.seq_lens.tolist() == [5, ROW - (B + 1)]
    calls = []
    w = make_step(serving_budget=SimpleNamespace(
        choose=lambda bs: 3 + bs, start_step=lambda bs, b: calls.append((bs, b))))
    assert w.begin_step(make_batch()).budget == 5 and calls == [(2, 5)]
    stale = make_batch()
    stale.spec_info = object()
    with pytest.raises(RuntimeError, match="DFlashDraftInputV2"):
        w.begin_step(stale)


def test_the_tree_stage_is_the_core_tree_stage_at_the_plan_s_width(monkeypatch):
    w = make_step(env={"SGLANG_DDTREE_BUDGETS": "5"})  # candidates 5 and B = 8
    batch = make_batch()
    hidden = torch.randn(2, BLOCK, H)
    tree = tree_from(w, batch, plan_of(batch, 5), hidden)
    logits = hidden[:, 1:] @ LM_HEAD.weight.T
    full = unpack_tree_stage(tree_stage(
        logits, batch.spec_info.bonus_tokens, batch.seq_lens, B, 3, build_draft_tree), B)
    assert tree.layout.tree_parents.shape == (2, 6) and tree.grammar_tree is None
    assert torch.equal(tree_from(w, batch, plan_of(batch), hidden).mask_positions,
                       full.mask_positions[B + 1])
    assert torch.equal(tree.layout.draft_tokens.view(2, 6),
                       full.layouts[B + 1].draft_tokens.view(2, B + 1)[:, :6])
    assert tree.depth_probs.shape == (2, 2, 3)  # the candidates' statistics
    assert make_step().draft_tree(batch, plan_of(batch)).depth_probs is None  # pinned: none
    started = []
    monkeypatch.setattr(sg, "GrammarTree", SimpleNamespace(
        from_device=lambda **kw: started.append(kw) or "tree copy"))
    batch.has_grammar = True
    assert tree_from(w, batch, plan_of(batch, 5), hidden).grammar_tree == "tree copy"
    assert started[0]["draft_token"].shape == (2, 6)
    assert torch.equal(started[0]["retrieve_next_token"], tree.layout.retrieve_next_token)


def test_a_forced_spine_roots_the_trees_of_constrained_batches(monkeypatch):
    """SGLANG_DDTREE_GRAMMAR_FORCE=spine: once the grammars hold the last step's tokens (the
    barrier), each request's spine enters the tree stage and takes its first depths."""
    w = make_step(env={"SGLANG_DDTREE_GRAMMAR_FORCE": "spine"})
    batch = make_batch(has_grammar=True)
    hidden = torch.randn(2, BLOCK, H)
    order = []
    monkeypatch.setattr(sg, "GrammarTree", SimpleNamespace(from_device=lambda **kw: None))
    monkeypatch.setattr(wmod, "grammar_spines", lambda reqs, depth, device: order.append(
        "spines") or torch.tensor([[5, 6, -1], [-1, -1, -1]]))
    tree = tree_from(w, batch, plan_of(batch), hidden, lambda: order.append("barrier"))
    assert order == ["barrier", "spines"]
    lay = tree.layout
    assert lay.draft_tokens.view(2, B + 1)[0, 1:3].tolist() == [5, 6]  # root -> 5 -> 6
    assert lay.tree_parents[0, 1:3].tolist() == [0, 1]
    plain = tree_from(make_step(), batch, plan_of(batch), hidden)  # not forced: the drafter's
    assert torch.equal(lay.draft_tokens.view(2, B + 1)[1], plain.layout.draft_tokens.view(
        2, B + 1)[1])


def test_the_draft_starts_from_the_plan_s_relay_state():
    w = make_step()
    batch = make_batch()
    plan = w.begin_step(batch)
    roots = plan.draft_input.bonus_tokens.clone()
    batch.spec_info = "replaced by a later stage"
    tree = w.draft_tree(batch, plan)
    assert w.io.calls == [("draft", plan.draft_input)]
    assert torch.equal(tree.layout.draft_tokens.view(2, B + 1)[:, 0], roots)  # the roots


def test_a_tree_from_the_draft_graph_s_tail_is_the_eager_tree():
    """The draft CUDA graph's tail hook (TreeStage.tail_hook, run inside SGLang's capture)
    leaves the same trees in the stage's buffers as the eager path, reading the roots from the
    block's first token and the lengths from the draft batch; the step then reads them as they
    are."""
    w = make_step(env={"SGLANG_DDTREE_BUDGETS": "5"})
    batch = make_batch()
    plan = plan_of(batch)
    hidden = torch.randn(2, BLOCK, H)
    eager = tree_from(w, batch, plan, hidden)
    eager = {k: v.clone() for k, v in vars(eager.layout).items()}
    w.stages.tree.out.write([torch.zeros_like(b) for b in w.stages.tree.out.buffers], 6)
    block_ids = torch.tensor([[3, 1, 1, 1], [7, 1, 1, 1]])  # [bonus, MASK...]
    draft_batch = SimpleNamespace(input_ids=block_ids.reshape(-1), seq_lens=batch.seq_lens)
    w.stages.tree.tail_hook(None, SimpleNamespace(hidden_states=hidden.view(-1, H)),
                            draft_batch, 2 * BLOCK)
    w.io.draft_block = lambda batch, draft_input: (None, True)  # the graph ran, with its tail
    tail = w.draft_tree(batch, plan)
    for name, value in eager.items():
        assert torch.equal(getattr(tail.layout, name), value), name


def test_verify_runs_through_the_width_s_runtime_and_builds_the_grammar_mask(monkeypatch):
    serving_budget = SimpleNamespace(runtimes={6: ("narrow backend", "narrow graphs")})
    w = make_step(serving_budget=serving_budget)
    runner = w.io.target_runner
    w.io.verify_out = SimpleNamespace(next_token_logits=torch.zeros(3, V))
    built = []

    def start(batch, grammar_tree, width, barrier, device, method, costs):
        barrier()
        built.append(dict(tree=grammar_tree, width=width, method=method, costs=costs))
        return "grammar step"

    monkeypatch.setattr(wmod, "start_grammar_step", start)
    tree = DraftedTree(layout=None, depth_probs=None, grammar_tree="tree copy")
    barrier = []
    batch = make_batch()
    with w.verify_runtime(6):
        out = w.verify(batch, plan_of(batch, 5), tree, lambda: barrier.append(1))
    assert w.io.calls == [("verify", ("narrow backend", "narrow graphs"))]
    assert (runner.attn_backend, runner.decode_cuda_graph_runner) == ("configured backend",
                                                                      "configured graphs")
    assert out.grammar_step == "grammar step" and out.out_cache_loc == "slots"
    assert out.forward_batch == "verify batch" and out.can_run_graph
    assert barrier == [1]
    assert built[0] == dict(tree="tree copy", width=6, method="tree", costs=w.mask_costs)

    def broken(*a):
        raise RuntimeError("verify failed")

    w.io.target_verify = broken
    with pytest.raises(RuntimeError, match="verify failed"), w.verify_runtime(6):
        w.verify(batch, plan_of(batch, 5), tree, None)
    assert runner.attn_backend == "configured backend"  # restored on failure too


class EvenTokens:
    """A grammar mask allowing even token ids only (SGLang's GrammarMask.apply contract)."""

    def apply(self, logits: torch.Tensor) -> None:
        logits[:, 1::2] = float("-inf")


def test_sample_and_accept_masks_every_node_before_choosing():
    w = make_step()
    batch = make_batch()
    plan = plan_of(batch)
    tree = drafted(w, batch, plan)
    logits = torch.randn(2 * (B + 1), V, generator=torch.Generator().manual_seed(2))
    verified = Verified(logits_output=None, logits=logits.clone(), forward_batch=None,
                        can_run_graph=True, grammar_step=GrammarStep(mask=EvenTokens()),
                        out_cache_loc=torch.arange(2 * (B + 1)))
    acc = w.sample_and_accept(batch, plan, tree, verified)
    assert (acc.choice % 2 == 0).all()  # every node's choice obeys the grammar
    masked = logits.clone()
    masked[:, 1::2] = float("-inf")
    assert torch.equal(acc.choice, masked.argmax(-1).view(2, B + 1))
    lay = tree.layout
    ref = StepCommit(*accept_stage(lay.draft_tokens.view(2, B + 1), lay.tree_parents,
                                   lay.tree_depths, acc.choice, 3, BLOCK))
    for got, want in zip(vars(acc.commit).values(), vars(ref).values()):
        assert torch.equal(got, want)
    committed = [acc.commit.tokens[r, :acc.commit.commit_lens[r]] for r in range(2)]
    assert all((t % 2 == 0).all() for t in committed) and acc.penalties is None


def test_sample_and_accept_without_a_grammar_is_the_plain_argmax():
    w = make_step()
    batch = make_batch()
    plan = plan_of(batch)
    tree = drafted(w, batch, plan)
    logits = torch.randn(2 * (B + 1), V)
    verified = Verified(None, logits.clone(), None, True, None, torch.arange(2 * (B + 1)))
    assert torch.equal(w.sample_and_accept(batch, plan, tree, verified).choice,
                       logits.argmax(-1).view(2, B + 1))


def test_grammar_traversal_over_the_tree_sees_each_node_s_own_path():
    """SGLang's bitmask traversal walks DDTREE's tree through its first-child / next-sibling
    links: every node's mask is filled with the grammar advanced along exactly that node's
    path from the root (and rolled back after), so each node's row constrains its own prefix."""
    from sglang.srt.speculative.spec_utils import generate_token_bitmask

    w = make_step()
    batch = make_batch()
    tree = drafted(w, batch, plan_of(batch))
    lay = tree.layout
    n = B + 1

    class Recorder:
        def __init__(self):
            self.path, self.filled = [], {}

        def allocate_vocab_mask(self, vocab_size, batch_size, device):
            return torch.full((batch_size, (vocab_size + 31) // 32), -1, dtype=torch.int32)

        def accept_token(self, t):
            self.path.append(t)

        def rollback(self, k):
            del self.path[-k:]

        def is_terminated(self):
            return False

        def fill_vocab_mask(self, mask, idx):
            self.filled[idx] = list(self.path)

    reqs = [SimpleNamespace(grammar=Recorder()), SimpleNamespace(grammar=None)]
    generate_token_bitmask(reqs, lay.retrieve_next_token, lay.retrieve_next_sibling,
                           lay.draft_tokens.view(2, n), V)
    rec = reqs[0].grammar
    assert sorted(rec.filled) == list(range(n)) and rec.path == []
    tokens, parents = lay.draft_tokens.view(2, n)[0].tolist(), lay.tree_parents[0].tolist()
    for i in range(n):
        path, j = [], i
        while j > 0:
            path.append(tokens[j])
            j = parents[j]
        assert rec.filled[i] == path[::-1], i


def test_commit_adds_logprobs_in_sglang_s_spec_layout(monkeypatch):
    from ddtree_sglang.sampling.logprobs import committed_log_probs

    w = make_step()
    batch = make_batch(return_logprob=True, top_logprobs_nums=[3, 0],
                       token_ids_logprobs=[None, [1, 2]])
    plan = plan_of(batch)
    tree = drafted(w, batch, plan)
    logits = torch.randn(2 * (B + 1), V)
    out = SimpleNamespace(next_token_logits=logits, hidden_states=None, customized_info=None)
    verify_slots = 100 + torch.arange(2 * (B + 1))
    verified = Verified(out, logits, "fb", True, None, out_cache_loc=verify_slots)
    acc = w.sample_and_accept(batch, plan, tree, verified)
    published = []
    w.io.calls.clear()
    result = w.commit(batch, plan, tree, verified, acc, published.append)
    step = acc.commit
    assert w.io.calls == [("recurrent", None), ("move", acc.slots.kv_target),
                          ("features", acc.slots.draft_slots)]
    assert acc.slots.kv_target[:, 0].tolist() == [100, 100 + B + 1]  # each request's own slots
    assert torch.equal(result.accept_lens, step.commit_lens)
    assert torch.equal(result.next_token_ids, step.tokens.reshape(-1))
    assert torch.equal(published[0], batch.seq_lens + step.commit_lens)
    assert result.speculative_num_draft_tokens == BLOCK
    assert out.next_token_logprobs.shape == (2, BLOCK)
    lp = torch.log_softmax(logits, -1)
    for r in range(2):
        for j in range(int(step.commit_lens[r])):
            row = int(step.feature_rows[r, j])
            assert torch.isclose(out.next_token_logprobs[r, j], lp[row, step.tokens[r, j]])
    assert len(out.next_token_top_logprobs_val) == 2 * BLOCK
    first = out.next_token_top_logprobs_val[0]
    assert torch.allclose(first, lp[int(step.feature_rows[0, 0])].topk(3).values)
    assert len(out.next_token_top_logprobs_val[BLOCK]) == 0  # the second request asked for 0
    ids_val = out.next_token_token_ids_logprobs_val[BLOCK]
    assert torch.allclose(torch.as_tensor(ids_val),
                          lp[int(step.feature_rows[1, 0])][[1, 2]])
    # sampling rows: the temperature divides before the softmax (greedy rows: 1)
    row_lp, token_lp = committed_log_probs(logits, step.feature_rows, step.tokens,
                                           torch.tensor([[0.5], [1.0]]))
    assert torch.isclose(token_lp[0, 0], torch.log_softmax(
        logits[int(step.feature_rows[0, 0])] / 0.5, -1)[step.tokens[0, 0]])


def test_grammar_masked_tokens_get_the_lowest_finite_logprob():
    from ddtree_sglang.sampling.logprobs import committed_log_probs

    logits = torch.full((1, 5), float("-inf"))
    logits[0, 1] = 0.0  # the grammar allows one token
    row_lp, token_lp = committed_log_probs(logits, torch.tensor([[0, 0]]),
                                           torch.tensor([[1, 3]]), None)
    assert token_lp[0, 0] == 0.0 and token_lp[0, 1] == torch.finfo(torch.float32).min
    assert torch.isfinite(row_lp).all()


def test_a_whole_step_commits_what_the_reference_walk_commits():
    """A decode step from the relay state to SGLang's result, on the fake I/O: the target's
    argmax at every node of the tree the drafter's states give, walked as the core walks it,
    the KV moves and draft-KV slots of that walk, the budget (pinned B) reported per request,
    and the next step's relay state; the verify ran inside the plan's width runtime."""
    w = make_step()
    batch = make_batch()
    hidden = torch.randn(2, BLOCK, H, generator=torch.Generator().manual_seed(4))
    w.io.hidden = hidden
    logits = torch.randn(2 * (B + 1), V, generator=torch.Generator().manual_seed(5))
    feats = torch.randn(2 * (B + 1), H)
    w.io.verify_out = SimpleNamespace(next_token_logits=logits.clone(), hidden_states=feats,
                                      customized_info=None)
    runtimes = []
    verify_runtime = w.verify_runtime
    w.verify_runtime = lambda width: runtimes.append(width) or verify_runtime(width)
    seq = batch.seq_lens.clone()
    mask_buffer = torch.zeros(2 * (B + 1) * (64 + B + 1), dtype=torch.uint8)
    w.stages.tree.set_mask_targets({B + 1: (mask_buffer, 4)})
    result = w.run(batch)
    assert w.io.mask_buffer is mask_buffer  # the verify reads the blocks the tree stage wrote
    tree = unpack_tree_stage(tree_stage(hidden[:, 1:] @ LM_HEAD.weight.T,
                                        torch.tensor([3, 7]), seq, B, 3, build_draft_tree), B)
    lay = tree.layouts[B + 1]
    ref = StepCommit(*accept_stage(lay.draft_tokens.view(2, B + 1), lay.tree_parents,
                                   lay.tree_depths, logits.argmax(-1).view(2, B + 1), 3, BLOCK))
    assert torch.equal(result.next_token_ids, ref.tokens.reshape(-1))
    assert torch.equal(result.accept_lens, ref.commit_lens)
    assert torch.equal(result.new_seq_lens, seq + ref.commit_lens)
    assert torch.equal(result.next_draft_input.bonus_tokens, ref.bonus)
    assert runtimes == [B + 1]
    moved = next(c[1] for c in w.io.calls if c[0] == "move")
    slots = 100 + torch.arange(2 * (B + 1))  # the fake verify's KV slots
    assert torch.equal(moved, slots.view(2, B + 1)[:, :BLOCK])  # each path's committed slots
    assert [c[0] for c in w.io.calls] == ["draft", "verify", "recurrent", "move", "features"]
    assert w.io.calls[2][1] == "configured backend"  # the recurrent commit: the verify's backend


def test_end_step_feeds_the_budget_controller_and_traces_the_budget():
    observed, clock = [], []
    w = make_step(serving_budget=SimpleNamespace(observe=lambda *a: observed.append(a)),
                  clock=SimpleNamespace(end=lambda: clock.append("end")))
    commit_lens = torch.tensor([2, 3])
    out = SimpleNamespace(customized_info=None)
    tree = DraftedTree(layout=None, depth_probs="probs", grammar_tree=None)
    accepted = SimpleNamespace(commit=SimpleNamespace(commit_lens=commit_lens))
    w.end_step(StepPlan(2, 5), tree, SimpleNamespace(logits_output=out), accepted)
    assert observed == [(2, 5, "probs", commit_lens)] and clock == ["end"]
    assert out.customized_info == {"ddtree_budget": [5, 5]}


class EvenMatcher:
    """An xgrammar-like matcher whose grammar allows even token ids only."""

    def __init__(self, vocab: int) -> None:
        self.vocab, self.depth = vocab, 0

    def accept_token(self, token: int) -> bool:
        self.depth += token % 2 == 0
        return token % 2 == 0

    def rollback(self, k: int = 1) -> None:
        self.depth -= k

    def is_terminated(self) -> bool:
        return False

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int = 0) -> None:
        from ddtree_sglang.grammar.masks import bitmask_words

        bits = torch.zeros(bitmask_words(self.vocab) * 32, dtype=torch.int64)
        bits[0:self.vocab:2] = 1
        words = (bits.view(-1, 32) << torch.arange(32)).sum(-1)
        bitmask[index] = words.to(torch.int64).view(-1).to(torch.int32)


def test_a_sampled_walk_masks_only_its_path_and_commits_what_full_masks_commit():
    """A request walked with a mask per visited node (SGLANG_DDTREE_GRAMMAR=path for a
    sampled or logprob request) commits what masking every node commits, and its visited rows
    carry the masked logits."""
    from ddtree_sglang.grammar.masks import PathWalk

    w = make_step()
    batch = make_batch()
    plan = plan_of(batch)
    tree = drafted(w, batch, plan)
    lay, n = tree.layout, B + 1
    logits = torch.randn(2 * n, V, generator=torch.Generator().manual_seed(4))
    matcher = EvenMatcher(V)
    walk = PathWalk(matcher, lay.retrieve_next_token[0].tolist(),
                    lay.retrieve_next_sibling[0].tolist(),
                    lay.draft_tokens.view(2, n)[0].tolist())
    step = GrammarStep(mask=None, sampled=Walks((0,), (walk,), ("r",)))
    verified = Verified(None, logits.clone(), None, True, step, torch.arange(2 * n))
    acc = w.sample_and_accept(batch, plan, tree, verified)
    full = logits.clone()
    full[:n, 1::2] = float("-inf")  # request 0 masked at every node
    want = full.argmax(-1).view(2, n)
    ref = StepCommit(*accept_stage(lay.draft_tokens.view(2, n), lay.tree_parents,
                                   lay.tree_depths, want, 3, BLOCK))
    assert torch.equal(acc.commit.tokens, ref.tokens)
    assert torch.equal(acc.commit.commit_lens, ref.commit_lens)
    visited = sorted(walk.choices)
    assert torch.equal(acc.logits[visited], full[visited]) and matcher.depth == 0
    assert len(visited) == int(acc.commit.commit_lens[0])  # one mask per committed token
    assert w.mask_costs.walk_us["r"] > 0


def test_per_node_sampling_draws_each_row_with_its_request_s_settings():
    """sample_per_node (every node) and sample_for_requests (any rows, e.g. a sampled walk's
    visited nodes) draw a row with its own request's temperature, min-p and seed: the same
    seeded draw whichever way the rows are gathered."""
    from ddtree_sglang.sampling.sample import sample_rows

    n, gen = 5, torch.Generator().manual_seed(9)
    logits = torch.randn(2 * n, V, generator=gen)
    si = SimpleNamespace(is_all_greedy=False, temperatures=torch.tensor([[0.7], [1.3]]),
                         top_ks=torch.tensor([V, V]), top_ps=torch.tensor([1.0, 1.0]),
                         min_ps=torch.tensor([0.0, 0.05]), need_top_k_sampling=False,
                         need_top_p_sampling=False, need_min_p_sampling=True)
    seeds, positions = torch.tensor([11, 12]), torch.arange(2 * n) % n + 40
    got = wmod.sample_per_node(logits, si, n, seeds, positions)
    want = sample_rows(logits, si.temperatures.repeat_interleave(n, 0), None, None,
                       si.min_ps.repeat_interleave(n, 0), seeds=seeds.repeat_interleave(n),
                       positions=positions)
    assert torch.equal(got, want)
    rows = torch.tensor([7, 2, 9])  # request 1's node 2, request 0's node 2, request 1's node 4
    some = wmod.sample_for_requests(logits[rows], si, rows // n, seeds, positions[rows])
    assert torch.equal(some, got[rows])
    greedy = SimpleNamespace(is_all_greedy=True)
    assert torch.equal(wmod.sample_per_node(logits, greedy, n), logits.argmax(-1))


def test_a_simulated_acceptance_commits_the_forced_length_along_the_best_path(monkeypatch):
    """SGLANG_SIMULATE_ACC_LEN (SGLang's benchmark knob, honoured as its DFLASH does): every
    request commits the length drawn for the step, along its tree's first-child chain, the
    bonus being the target's choice there ("real-draft-token") or SGLang's fixed id."""
    for mode, fixed in (("real-draft-token", None), ("fixed", 100)):
        settings = DDTreeSettings.from_values(B, BLOCK, environ={"SGLANG_DDTREE_BUDGETS": "off"})
        stages = GraphedStages(Kernels(), B, BLOCK - 1, BLOCK,
                               functools.partial(draft_logits, LM_HEAD, vocab_size=V),
                               settings.budgets, max_bs=6, hidden_size=H, graphed=False,
                               simulated=SimulatedAcceptance(lambda budget: 2.5, mode))
        w = wmod.DecodeStep(settings, V, FakeIO(), stages, PenaltyState(6, V, "cpu"),
                            MaskCosts())
        monkeypatch.setattr(sg, "simulated_commit_len", lambda mean, max_len: 3)
        batch = make_batch()
        tree = drafted(w, batch, plan_of(batch))
        logits = torch.randn(2 * (B + 1), V)
        verified = Verified(None, logits.clone(), None, True, None, torch.arange(2 * (B + 1)))
        acc = w.sample_and_accept(batch, plan_of(batch), tree, verified)
        assert acc.commit.commit_lens.tolist() == [3, 3]
        lay = tree.layout
        for r in range(2):
            first = lay.retrieve_next_token[r]
            path = [0, int(first[0]), int(first[int(first[0])])]
            toks = lay.draft_tokens.view(2, B + 1)[r]
            want = [int(toks[path[1]]), int(toks[path[2]]),
                    int(logits.view(2, B + 1, V)[r, path[2]].argmax())]
            assert acc.commit.tokens[r, :3].tolist() == (want if fixed is None else [fixed] * 3)


def test_a_simulated_curve_commits_each_budget_s_mean(monkeypatch):
    """SGLANG_DDTREE_SIMULATE_ACC: a step at budget b commits lengths drawn by SGLang's own draw
    (its default method) around the curve's tau(b), so the budgets' mean commit lengths come
    out as configured, on trees whose best path is too short for them (random drafter states)."""
    curve = ((5, 2.2), (8, 3.4))
    settings = DDTreeSettings.from_values(B, BLOCK, environ={"SGLANG_DDTREE_BUDGETS": "5"})
    stages = GraphedStages(Kernels(), B, BLOCK - 1, BLOCK,
                           functools.partial(draft_logits, LM_HEAD, vocab_size=V),
                           settings.budgets, max_bs=6, hidden_size=H, graphed=False,
                           simulated=sg.simulated_acceptance(curve))
    w = wmod.DecodeStep(settings, V, FakeIO(), stages, PenaltyState(6, V, "cpu"), MaskCosts())
    torch.manual_seed(0)  # SGLang's draw samples from torch's global generator
    batch = make_batch()
    for budget, tau in curve:
        plan = plan_of(batch, budget)
        tree = drafted(w, batch, plan)
        logits = torch.randn(2 * plan.width, V)
        lens = []
        for _ in range(300):
            verified = Verified(None, logits.clone(), None, True, None,
                                torch.arange(2 * plan.width))
            lens += w.sample_and_accept(batch, plan, tree, verified).commit.commit_lens.tolist()
        assert abs(sum(lens) / len(lens) - tau) < 0.1, (budget, sum(lens) / len(lens))


def test_a_step_without_speculation_drafts_nothing_and_decodes_one_token():
    """Budget 0 (SGLANG_DDTREE_BUDGETS with 0): no drafter pass, the roots alone verify at
    width 1, each request commits the target's own next token (plain decoding), its root's
    features still enter the draft KV (a later step can draft again), and the budget learns
    nothing from it."""
    observed = []
    w = make_step(env={"SGLANG_DDTREE_BUDGETS": "0"}, serving_budget=SimpleNamespace(
        choose=lambda bs: 0, start_step=lambda bs, b: None,
        observe=lambda *a: observed.append(a), runtimes={1: ("w1 backend", "w1 graphs"),
                                                        B + 1: ("wide", "graphs")}))
    batch = make_batch()
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(6))
    w.io.verify_out = SimpleNamespace(next_token_logits=logits.clone(),
                                      hidden_states=torch.randn(2, H), customized_info=None)
    seq = batch.seq_lens.clone()
    result = w.run(batch)
    assert [c[0] for c in w.io.calls] == ["verify", "recurrent", "move", "features"]  # no draft
    assert w.io.calls[0][1] == ("w1 backend", "w1 graphs")  # the width-1 runtime
    assert result.accept_lens.tolist() == [1, 1]
    assert result.next_token_ids.view(2, BLOCK)[:, 0].tolist() == logits.argmax(-1).tolist()
    assert torch.equal(result.new_seq_lens, seq + 1)
    assert observed[0][:3] == (2, 0, None)  # no tree: no predictions to learn from
    assert w.io.calls[1][1] == "w1 backend"  # committed through the backend that verified
    features = w.io.calls[3][1]  # the draft-KV slots: each request's root at its own slot
    assert features[:, 0].tolist() == [100, 101]
