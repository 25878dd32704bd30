"""model_io.DFlashModelIO on the CPU over a fake DFLASH worker: what the decode step's calls
hand to SGLang (the verify input, host lengths, KV slots, draft-KV positions) and what they
leave on the batch."""
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("sglang")

from ddtree_sglang.kernels.choice import Kernels  # noqa: E402
from ddtree_sglang.tree.verify_layout import build_verify_layout  # noqa: E402
from ddtree_sglang.sglang_plugin import model_io, sglang_api as sg  # noqa: E402
from ddtree_sglang.sglang_plugin.draft_input import make_draft_input  # noqa: E402
from ddtree_sglang.tree.builder import build_draft_tree  # noqa: E402

BLOCK, B, V = 4, 5, 30


def fake_worker(calls: list):
    def forward(batch, forward_batch, is_verify):
        calls.append(("forward", forward_batch, is_verify))
        return SimpleNamespace(logits_output="logits output")

    def append(**kw):
        calls.append(("append", kw))

    pool = SimpleNamespace(req_to_token=torch.zeros(4, 64, dtype=torch.int32))
    runner = SimpleNamespace(req_to_token_pool=pool, token_to_kv_pool_allocator=None)
    return SimpleNamespace(target_worker=SimpleNamespace(model_runner="target runner",
                                                         forward_batch_generation=forward),
                           model_runner=runner, device="cpu",
                           _append_target_hidden_to_draft_kv_by_loc=append)


def layout(bs: int = 2):
    gen = torch.Generator().manual_seed(0)
    logp = torch.log_softmax(torch.randn(bs, BLOCK - 1, V, generator=gen), -1)
    tree = build_draft_tree(logp, B)
    return build_verify_layout(tree, torch.tensor([3, 4]), torch.tensor([7, 9]))


def test_target_verify_hands_sglang_the_tree_and_restores_the_host_lengths(monkeypatch):
    calls = []
    io = model_io.DFlashModelIO(fake_worker(calls), Kernels(), BLOCK, B + 1, V)
    seen = {}

    def prepare(verify_input, req_to_token_pool, batch, target_worker):
        seen.update(spec=batch.spec_info, cpu=batch.seq_lens_cpu.tolist(),
                    total=batch.seq_lens_sum, input=verify_input)
        batch.out_cache_loc = torch.arange(2 * (B + 1))  # SGLang assigns the tree's slots
        return "verify batch", True

    monkeypatch.setattr(sg, "eagle_prepare_for_verify", prepare)
    relay = make_draft_input(torch.tensor([3, 4]), torch.tensor([7, 9]))
    lay = layout()
    batch = SimpleNamespace(seq_lens=torch.tensor([7, 9]), seq_lens_cpu=torch.tensor([7, 9]),
                            seq_lens_sum=16, spec_info=relay, out_cache_loc=None)
    out, fb, graphed, slots = io.target_verify(batch, relay, lay)
    assert (out, fb, graphed) == ("logits output", "verify batch", True)
    assert torch.equal(slots, torch.arange(2 * (B + 1)))
    assert seen["cpu"] == [7 + B + 1, 9 + B + 1] and seen["total"] == 16 + 2 * (B + 1)
    assert seen["spec"] is seen["input"] and seen["input"].draft_token_num == B + 1
    assert seen["input"].spec_steps == BLOCK - 1 and seen["input"].topk == 1
    assert torch.equal(seen["input"].draft_token, lay.draft_tokens)
    assert batch.seq_lens_cpu.tolist() == [7, 9] and batch.seq_lens_sum == 16  # restored
    assert calls == [("forward", "verify batch", True)]


def test_committed_features_go_to_their_chain_slots_and_positions():
    """The draft-KV append writes each committed token's target features at the slot and
    chain position the walk's commit stage computed, then drops the output's copy."""
    from ddtree_sglang.tree.stages import accept_stage, commit_stage, unpack_commit_stage

    calls = []
    io = model_io.DFlashModelIO(fake_worker(calls), Kernels(), BLOCK, B + 1, V)
    lay, n = layout(), B + 1
    choice = lay.draft_tokens.view(2, n).roll(-1, 1)  # any choices
    verify_slots = torch.arange(100, 100 + 2 * n).view(2, n)
    step, slots = unpack_commit_stage(commit_stage(
        accept_stage, lay.draft_tokens.view(2, n), lay.tree_parents, lay.tree_depths, choice,
        verify_slots, torch.tensor([7, 9]), BLOCK - 1, BLOCK))
    feats = torch.randn(2 * n, 3)
    out = SimpleNamespace(hidden_states=feats)
    io.append_committed_features(out, step, slots)
    kw = calls[0][1]
    assert torch.equal(kw["target_hidden"], feats[step.feature_rows.reshape(-1)])
    assert kw["positions"].view(2, BLOCK).tolist() == [[7, 8, 9, 10], [9, 10, 11, 12]]
    assert kw["cache_loc_2d"].shape == (2, BLOCK) and kw["cache_loc_2d"][1, 0] == 100 + n
    assert torch.equal(kw["commit_lens"], step.commit_lens)
    assert out.hidden_states is None  # no host copy of the features under overlap
    with pytest.raises(RuntimeError, match="hidden states"):
        io.append_committed_features(out, step, slots)


def test_the_step_bound_and_the_relay_state():
    io = model_io.DFlashModelIO(fake_worker([]), Kernels(), BLOCK, B + 1, V)
    assert io.max_step_seq_len() == 64 - (B + 1)
    nxt = io.next_draft_input(torch.tensor([5, 6]), torch.tensor([10, 12]))
    assert isinstance(nxt, sg.DFlashDraftInputV2) and nxt.bonus_tokens.tolist() == [5, 6]
    hidden = torch.randn(2, 3, 8)
    head = SimpleNamespace(weight=torch.randn(V + 2, 8))  # a padded vocabulary
    assert torch.allclose(model_io.draft_logits(head, hidden, V), (hidden @ head.weight.T)[..., :V])


def test_a_hybrid_target_s_recurrent_state_is_committed_through_the_verify_s_backend(monkeypatch):
    """The commit goes through the backend that ran the verify, with SGLang's track interval
    only when the batch tracks prefix states; a target without recurrent layers commits
    nothing."""
    from ddtree_sglang.sglang_plugin import hybrid

    io = model_io.DFlashModelIO(fake_worker([]), Kernels(), BLOCK, B + 1, V)
    io.target_runner = SimpleNamespace(model="the target")
    calls = []
    monkeypatch.setattr(hybrid, "commit_recurrent_state",
                        lambda *a: calls.append(a))
    monkeypatch.setattr(sg, "mamba_track_interval", lambda: 64)
    batch = SimpleNamespace(mamba_track_indices=None)
    io.commit_recurrent_state(SimpleNamespace(), batch, "step", 9)  # no recurrent layers
    assert calls == []
    monkeypatch.setattr(hybrid, "linear_backend", lambda backend: "linear half")
    io.commit_recurrent_state("verify backend", batch, "step", 9)
    batch.mamba_track_indices = torch.tensor([3])
    io.commit_recurrent_state("verify backend", batch, "step", 9)
    assert calls == [("verify backend", "the target", batch, "step", 9, None),
                     ("verify backend", "the target", batch, "step", 9, 64)]
