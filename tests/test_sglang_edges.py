"""The adapter's exactness edges on CPU: finish state inside a multi-token commit, prompt
token ids, sliding-window targets, the bounded KV reservation, the penalty state table and
graph padding.  Real sglang 0.5.17 objects where they run without a GPU."""
import json
import os
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import server_args
import torch

sglang = pytest.importorskip("sglang")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
ROOT = Path(__file__).resolve().parents[1]
DRAFTER = ROOT / "testbed" / "drafter"


@pytest.fixture(scope="module")
def hooks_loaded():
    from sglang.srt.plugins import load_plugins

    load_plugins()


@pytest.fixture
def serving_ddtree(monkeypatch):
    from ddtree_sglang.sglang_plugin import sglang_api as sg

    monkeypatch.setattr(sg, "runtime_spec",
                        lambda: SimpleNamespace(speculative_algorithm="DDTREE",
                                                speculative_num_draft_tokens=33))


def _req(max_new, ignore_eos=False, stop_ids=None):
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    sp = SamplingParams(max_new_tokens=max_new, stop_token_ids=stop_ids, ignore_eos=ignore_eos)
    sp.normalize(None)
    return Req("r", "", [1, 2, 3], sp, vocab_size=50, eos_token_ids={2})


def _commit(req, tokens):
    req.output_ids.extend(tokens)
    req.update_finish_state(len(tokens))
    return req.finished_reason, req.finished_len, list(req.output_ids[: req.finished_len])


@pytest.mark.parametrize("max_new", range(3, 9))
def test_eos_inside_a_commit_that_crosses_max_new_tokens(hooks_loaded, serving_ddtree, max_new):
    """Plain decoding, one token a step, is the reference: EOS (id 2) at output index 4."""
    plain = _req(max_new)
    for t in [10, 11, 12, 13, 2, 14, 15, 16]:
        plain.output_ids.append(t)
        plain.update_finish_state(1)
        if plain.finished():
            break
    spec = _req(max_new)
    _commit(spec, [10, 11])
    reason, length, out = _commit(spec, [12, 13, 2, 14, 15, 16])
    assert type(reason).__name__ == type(plain.finished_reason).__name__
    assert out == list(plain.output_ids[: plain.finished_len])
    if max_new >= 6:  # EOS is output #5; at max_new = 5 plain decoding reports "length"
        assert type(reason).__name__ == "FINISH_MATCHED_TOKEN" and out[-1] == 2
    else:
        assert type(reason).__name__ == "FINISH_LENGTH" and len(out) == max_new


def test_unhooked_sglang_ends_such_a_commit_with_length(hooks_loaded, monkeypatch):
    """What the hook fixes (it stands down for other algorithms): SGLang 0.5.17 alone."""
    from ddtree_sglang.sglang_plugin import sglang_api as sg

    monkeypatch.setattr(sg, "runtime_spec",
                        lambda: SimpleNamespace(speculative_algorithm="DFLASH"))
    req = _req(7)
    _commit(req, [10, 11])
    reason, length, out = _commit(req, [12, 13, 2, 14, 15, 16])
    assert type(reason).__name__ == "FINISH_LENGTH" and out == [10, 11, 12, 13, 2, 14, 15]


def test_stop_token_id_and_ignore_eos_inside_a_commit(hooks_loaded, serving_ddtree):
    req = _req(4, stop_ids=[12])
    reason, length, out = _commit(req, [10, 11, 12, 13, 14])
    assert type(reason).__name__ == "FINISH_MATCHED_TOKEN" and out == [10, 11, 12]
    req = _req(4, ignore_eos=True)
    reason, length, out = _commit(req, [10, 2, 12, 13, 14])
    assert type(reason).__name__ == "FINISH_LENGTH" and out == [10, 2, 12, 13]


def test_token_id_errors(hooks_loaded, serving_ddtree):
    from ddtree_sglang.sglang_plugin import plugin
    from sglang.srt.speculative import dflash_utils

    assert plugin.token_id_error([0, 5, 49], 50) is None
    msg = plugin.token_id_error([3, 50, 7], 50)
    assert "token id 50 at position 1" in msg and "accepted: token ids in 0..49" in msg
    assert "token id -1 at position 2" in plugin.token_id_error([3, 4, -1], 50)
    req = SimpleNamespace(return_logprob=False, return_hidden_states=False,
                          origin_input_ids=[1, 2, 99], vocab_size=50,
                          sampling_params=SimpleNamespace(json_schema=None, regex=None,
                                                          ebnf=None, structural_tag=None))
    assert "outside the model's vocabulary" in dflash_utils.validate_dflash_request(req, True)
    req.origin_input_ids = [1, 2, 3]
    assert dflash_utils.validate_dflash_request(req, True) is None


@pytest.mark.parametrize("cfg,refused", [
    ({"model_type": "gemma2", "sliding_window": 4096}, "sliding_window=4096"),
    ({"model_type": "gpt_oss", "layer_types": ["sliding_attention", "full_attention"]},
     "sliding_attention"),
    ({"model_type": "llama4", "text_config": {"attention_chunk_size": 8192}}, "chunked"),
    ({"model_type": "qwen2", "sliding_window": 131072, "use_sliding_window": False}, None),
    ({"model_type": "qwen3", "sliding_window": None}, None),
])
def test_sliding_window_targets_are_refused(tmp_path, cfg, refused):
    from ddtree_sglang.sglang_plugin.server_args import DDTreeConfigError, validate

    (tmp_path / "config.json").write_text(json.dumps(cfg))
    args = server_args(device="cuda", speculative_draft_model_path=str(DRAFTER),
                           speculative_num_draft_tokens=33, attention_backend="triton",
                           page_size=1, model_path=str(tmp_path))
    if refused is None:
        validate(args)
    else:
        with pytest.raises(DDTreeConfigError, match=re.escape(refused)):
            validate(args)


def test_kv_reservation_stays_inside_the_row(monkeypatch, serving_ddtree):
    """committed + 2N is capped at the req_to_token row width; the allocated watermark
    never shrinks."""
    from ddtree_sglang.sglang_plugin import draft_input, sglang_api as sg

    seen = {}
    monkeypatch.setattr(sg, "alloc_for_spec_decode",
                        lambda *a, **kw: seen.update(kw))
    width = 256 + 4 + 33  # context 256
    reqs = [SimpleNamespace(kv_committed_len=c, kv=SimpleNamespace(kv_allocated_len=a))
            for c, a in [(10, 20), (250, 280), (240, 293), (100, 170)]]
    batch = SimpleNamespace(batch_size=lambda: len(reqs), reqs=reqs, device="cpu",
                            req_to_token_pool=SimpleNamespace(req_to_token=torch.zeros(5, width)),
                            tree_cache=None, req_pool_indices=torch.arange(4))
    inp = draft_input.make_draft_input(torch.zeros(4, dtype=torch.long),
                                       torch.zeros(4, dtype=torch.long))
    inp.prepare_for_decode(batch)
    assert seen["nxt_kv_lens_cpu"].tolist() == [76, width, width, 170]
    assert seen["num_needed_tokens"] == 56 + (width - 280)
    assert batch.seq_lens_cpu.tolist() == [10, 250, 240, 100]
    assert draft_input.max_step_seq_len(batch.req_to_token_pool.req_to_token, 33) == 256 + 4


def test_penalty_state_counts_outputs_per_slot():
    from ddtree_sglang.sglang_plugin.request_state import (PenaltyState, min_new_stop_tokens,
                                                           penalty_settings, request_seeds)

    def req(slot, outputs, **sp):
        params = dict(frequency_penalty=0.0, presence_penalty=0.0, repetition_penalty=1.0,
                      min_new_tokens=0, stop_token_ids={9}, sampling_seed=None)
        params.update(sp)
        return SimpleNamespace(req_pool_idx=slot, output_ids=outputs,
                               sampling_params=SimpleNamespace(**params),
                               tokenizer=SimpleNamespace(eos_token_id=2,
                                                         additional_stop_token_ids={5}))

    plain = req(0, [])
    a = req(3, [], frequency_penalty=1.0)
    b = req(1, [4, 4, 7], min_new_tokens=5, sampling_seed=11)  # re-prefilled after retraction
    assert penalty_settings(plain) is None and penalty_settings(a) == (1.0, 0.0, 1.0, 0)
    assert min_new_stop_tokens(b) == {9, 2, 5}
    state = PenaltyState(rows=4, vocab=10, device="cpu")
    assert state.params([plain]) is None and state.counts is None  # nothing allocated
    state.on_prefill([plain, a, b], torch.tensor([6, 8, 4]))
    assert state.counts[3].tolist() == [0] * 8 + [1, 0] and int(state.out_len[3]) == 1
    assert state.counts[1, 4] == 3 and state.counts[1, 7] == 1 and int(state.out_len[1]) == 4
    slots = torch.tensor([3, 1])
    state.commit(slots, torch.tensor([[8, 8, 1, 0], [7, 0, 0, 0]]), torch.tensor([3, 1]))
    counts, out_len = state.rows_of(slots)
    assert counts[0, 8] == 3 and counts[0, 1] == 1 and counts[0, 0] == 0
    assert counts[1, 7] == 2 and out_len.tolist() == [4, 5]
    p = state.params([a, b])
    assert p.frequency.tolist() == [1.0, 0.0] and p.min_new_tokens.tolist() == [0, 5]
    assert sorted(t for t in p.stop_tokens[1].tolist() if t >= 0) == [2, 5, 9]
    assert request_seeds([a, plain], "cpu") is None
    assert request_seeds([a, b], "cpu").tolist() == [-1, 11]


def test_graph_padding_returns_the_real_rows():
    """A batch padded to a captured size (rows independent) gives the unpadded result."""
    from ddtree_sglang.kernels.graphed import GraphedFunction

    def fn(x, y):
        return (x * 2 + y.unsqueeze(1)).reshape(-1), x.sum(1)

    class FakeGraph:
        def __init__(self, static_in, static_out):
            self.static_in, self.static_out = static_in, static_out

        def replay(self):
            for dst, src in zip(self.static_out, fn(*self.static_in)):
                dst.copy_(src)

    static_in = [torch.zeros(8, 3), torch.zeros(8)]
    static_out = [torch.zeros(24), torch.zeros(8)]
    entry = (FakeGraph(static_in, static_out), static_in, static_out)
    x, y = torch.randn(5, 3), torch.randn(5)
    got = GraphedFunction._replay(entry, (x, y), 5, 8)
    want = fn(x, y)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert got[0].shape == (15,) and got[1].shape == (5,)
