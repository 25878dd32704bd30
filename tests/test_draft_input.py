"""sglang_plugin/draft_input.py: the decode step's KV reservation, bounded by the request's
row of SGLang's request-to-token table, and the relay state handed to the next step."""
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("sglang")

from ddtree_sglang.sglang_plugin import draft_input, sglang_api as sg  # noqa: E402

ROW = 100  # the req_to_token row: context + 4 + N
WIDTH = 10  # N, the verify width


@pytest.fixture
def allocations(monkeypatch):
    """Each alloc_for_spec_decode call's arguments, with the verify width SGLang runs at."""
    calls = []
    monkeypatch.setattr(sg, "runtime_spec",
                        lambda: SimpleNamespace(speculative_num_draft_tokens=WIDTH))
    monkeypatch.setattr(sg, "alloc_for_spec_decode",
                        lambda *a, **kw: calls.append({k: (v.clone() if torch.is_tensor(v) else v)
                                                       for k, v in kw.items()}))
    return calls


def batch_of(lengths):
    """A running batch: (committed, allocated) KV lengths per request."""
    reqs = [SimpleNamespace(kv_committed_len=c, kv=SimpleNamespace(kv_allocated_len=a))
            for c, a in lengths]
    return SimpleNamespace(batch_size=lambda: len(reqs), reqs=reqs, device="cpu",
                           req_to_token_pool=SimpleNamespace(
                               req_to_token=torch.zeros(8, ROW, dtype=torch.int32)),
                           tree_cache=None, req_pool_indices=torch.arange(len(reqs)),
                           seq_lens_cpu=None, seq_lens_sum=None)


def relay(bs: int) -> draft_input.DDTreeDraftInput:
    return draft_input.make_draft_input(torch.zeros(bs, dtype=torch.long),
                                        torch.zeros(bs, dtype=torch.long))


def test_the_reservation_is_min_of_committed_plus_2n_and_the_row(allocations):
    """committed + 2N where the row holds it, the row's end where it does not (DFLASH's
    unbounded committed + 2N would run into the next request's row), and never less than
    what is already allocated."""
    batch = batch_of([(20, 25),    # 20 + 2N = 40 fits the row
                      (85, 90),    # 85 + 2N = 105 > 100: the row's end
                      (50, 80)])   # already past 50 + 2N = 70: kept
    state = relay(3)
    state.prepare_for_decode(batch)
    (call,) = allocations
    assert call["nxt_kv_lens_cpu"].tolist() == [40, ROW, 80]
    assert call["cur_kv_lens_cpu"].tolist() == [25, 90, 80]
    assert call["nxt_kv_lens"].tolist() == [40, ROW, 80]  # the device copies
    assert call["num_needed_tokens"] == (40 - 25) + (ROW - 90) + 0
    assert call["reqs"] is batch.reqs
    assert batch.seq_lens_cpu.tolist() == [20, 85, 50] and batch.seq_lens_sum == 155
    assert state.reserved_seq_lens_cpu.tolist() == [40, ROW, 80]
    assert state.reserved_seq_lens_sum == 40 + ROW + 80


def test_every_step_that_runs_writes_inside_the_reservation(allocations):
    """A running request has committed <= context_len - 3 = ROW - 4 - N - 3; a step writes N
    slots past what it starts from, clamped to max_step_seq_len: inside the reservation."""
    last = ROW - 4 - WIDTH - 3
    committed = [1, last - WIDTH, last]
    batch = batch_of([(c, c) for c in committed])
    relay(3).prepare_for_decode(batch)
    reserved = allocations[0]["nxt_kv_lens_cpu"].tolist()
    limit = draft_input.max_step_seq_len(batch.req_to_token_pool.req_to_token, WIDTH)
    assert limit == ROW - WIDTH
    for c, r in zip(committed, reserved):
        assert min(c, limit) + WIDTH <= r <= ROW


def test_an_empty_batch_reserves_nothing(allocations):
    batch = batch_of([])
    relay(0).prepare_for_decode(batch)
    assert allocations == [] and batch.seq_lens_cpu is None


def test_the_relay_state_holds_the_bonus_tokens_and_lengths_as_int64():
    bonus = torch.tensor([3, 4], dtype=torch.int32)
    lens = torch.tensor([7, 9], dtype=torch.int32)
    state = draft_input.make_draft_input(bonus, lens)
    assert isinstance(state, sg.DFlashDraftInputV2)
    assert state.bonus_tokens.dtype == torch.int64 and state.bonus_tokens.tolist() == [3, 4]
    assert state.new_seq_lens.dtype == torch.int64 and state.new_seq_lens.tolist() == [7, 9]
    assert state.topk_p.shape == (2, 0) and state.hidden_states.shape == (2, 0)
    int64 = bonus.long()
    again = draft_input.make_draft_input(int64, lens.long())
    assert again.topk_p is state.topk_p  # DFLASH's unused fields: one set per batch size
    assert again.bonus_tokens is int64  # int64 already: no copy
    assert draft_input.make_draft_input(bonus[:1], lens[:1]).topk_p.shape == (1, 0)
