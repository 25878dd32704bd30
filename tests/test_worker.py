"""sglang_plugin/worker.py without a GPU: DDTreeWorker made without SGLang's __init__ (which
loads models), its parts that need none checked on stand-ins: attribute forwarding, DFLASH's
hooks it overrides, where a forward pass goes, the prefill's hand-off into the draft KV, the
verify-attention install and the largest batch the step's buffers hold.  The stand-ins hand the
worker what it reads, ready-made; its constructor and its startup in SGLang's order (the request
pool made after the worker) run in test_startup_order.py."""
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("sglang")

from ddtree_sglang.kernels.choice import Kernels  # noqa: E402
from ddtree_sglang.sglang_plugin import contract, sglang_api as sg  # noqa: E402
from ddtree_sglang.sglang_plugin.draft_input import DDTreeDraftInput  # noqa: E402


@pytest.fixture(scope="module")
def worker_class():
    contract.check_contract()  # as plugin._worker_factory does before the import
    from ddtree_sglang.sglang_plugin.worker import DDTreeWorker

    return DDTreeWorker


def bare(worker_class, **fields):
    """A DDTreeWorker with only `fields` set (SGLang's __init__ not run)."""
    worker = object.__new__(worker_class)
    worker._target_worker = fields.pop("target_worker", SimpleNamespace(device="cpu"))
    worker.ps = SimpleNamespace(tp_rank=1)  # not the logging rank
    vars(worker).update(fields)
    return worker


def test_ddtree_attributes_are_never_forwarded_to_the_target_worker(worker_class):
    """DFlashWorkerV2 forwards what it lacks to the target worker; a DDTREE attribute not
    (yet) set raises, naming it, even where the target has one of that name."""
    worker = bare(worker_class, target_worker=SimpleNamespace(device="cuda:3",
                                                              ddtree_step="the target's"))
    with pytest.raises(AttributeError, match="'ddtree_step'.*not forwarded"):
        _ = worker.ddtree_step
    with pytest.raises(AttributeError, match="'ddtree_setings'"):
        _ = worker.ddtree_setings
    assert worker.device == "cuda:3"  # SGLang's own still forward
    worker.ddtree_step = "mine"
    assert worker.ddtree_step == "mine"


def test_dflash_s_draft_sampler_is_not_built(worker_class):
    """DDTREE needs the drafter's whole distributions, so DFLASH's in-graph argmax is off."""
    assert bare(worker_class)._maybe_build_draft_sampler() is None


def test_the_next_step_s_relay_state_is_ddtree_s(worker_class):
    worker = bare(worker_class)
    bonus, lens = torch.tensor([5, 6], dtype=torch.int32), torch.tensor([10, 12])
    for made in (worker._make_next_draft_input_prefill(bonus_tokens=bonus, seq_lens=lens),
                 worker._make_next_draft_input_decode(bonus_tokens=bonus, new_seq_lens=lens)):
        assert type(made) is DDTreeDraftInput  # its reservation is bounded by the row
        assert made.bonus_tokens.tolist() == [5, 6] and made.bonus_tokens.dtype == torch.int64
        assert made.new_seq_lens.tolist() == [10, 12]


def mode(kind: str):
    return SimpleNamespace(is_extend=lambda: kind == "extend", is_idle=lambda: kind == "idle")


def test_a_forward_pass_goes_to_the_step_or_the_prefill(worker_class, monkeypatch):
    worker = bare(worker_class, ddtree_step=None)
    decode = SimpleNamespace(forward_mode=mode("decode"), is_extend_in_batch=False)
    with pytest.raises(RuntimeError, match="before init_cuda_graphs built the step"):
        worker.forward_batch_generation(decode)
    budget = SimpleNamespace(interrupted=0)
    budget.interrupt = lambda: setattr(budget, "interrupted", budget.interrupted + 1)
    worker.ddtree_step = SimpleNamespace(serving_budget=budget,
                                         run=lambda batch, publish, barrier: ("step", batch))
    assert worker.forward_batch_generation(decode) == ("step", decode)
    assert budget.interrupted == 0
    monkeypatch.setattr(sg.DFlashWorkerV2, "forward_batch_generation",
                        lambda self, batch, on_publish=None, grammar_barrier=None:
                        ("dflash", batch))
    idle = SimpleNamespace(forward_mode=mode("idle"), is_extend_in_batch=False)
    assert worker.forward_batch_generation(idle) == ("dflash", idle)  # DFLASH's idle pass
    assert budget.interrupted == 1  # a break in the decode steps: the budget's timing restarts


def test_the_prefill_hands_the_target_s_features_to_the_draft_kv(worker_class):
    """Two requests (prefix 3 + 2 new tokens, prefix 0 + 3): the target's hidden states go
    into the draft KV at the batch's slots and positions, leave the output, and the result
    carries the lengths and the relay state of the first decode step."""
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput

    hidden = torch.randn(5, 4)
    result = sg.GenerationBatchResult(
        logits_output=LogitsProcessorOutput(next_token_logits=torch.zeros(2, 8),
                                            hidden_states=hidden),
        next_token_ids=torch.tensor([7, 1]))
    appended, published, prefilled = [], [], []
    target = SimpleNamespace(forward_batch_generation=lambda batch, capture_hidden_mode: result)
    worker = bare(worker_class, target_worker=target,
                  model_runner=SimpleNamespace(
                      server_args=SimpleNamespace(attention_backend="torch_native")),
                  _append_target_hidden_to_draft_kv_by_loc=lambda **kw: appended.append(kw))
    step = SimpleNamespace(serving_budget=None, penalties=SimpleNamespace(
        on_prefill=lambda reqs, first: prefilled.append((reqs, first.tolist()))))
    batch = SimpleNamespace(forward_mode=mode("extend"), is_extend_in_batch=True,
                            prefix_lens=[3, 0], extend_lens=[2, 3], reqs=["a", "b"],
                            seq_lens=torch.tensor([5, 3]), out_cache_loc=torch.arange(20, 25))
    worker.ddtree_step = step
    assert worker.forward_batch_generation(batch, published.append) is result
    (kw,) = appended
    assert kw["target_hidden"] is hidden and kw["cache_loc"] is batch.out_cache_loc
    assert kw["positions"].tolist() == [3, 4, 0, 1, 2]
    assert result.logits_output.hidden_states is None  # no host copy under overlap
    assert result.new_seq_lens is batch.seq_lens and published == [batch.seq_lens]
    assert type(result.next_draft_input) is DDTreeDraftInput
    assert result.next_draft_input.bonus_tokens.tolist() == [7, 1]
    assert prefilled == [(["a", "b"], [7, 1])]

    result.logits_output.hidden_states = None  # a target that captured none
    with pytest.raises(RuntimeError, match="needs the target's captured hidden states"):
        worker.forward_batch_generation(batch)


def test_the_verify_attention_is_installed_on_a_triton_target_only(worker_class, monkeypatch):
    """The kernel the startup check kept replaces a triton target's extend kernel; on any
    other backend the worker records that it verifies with the backend's own ("single")."""
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    monkeypatch.setattr(sg.DFlashWorkerV2, "init_attention_backends", lambda self: None)

    def own_kernel(*a, **k):
        return "sglang's"

    triton = TritonAttnBackend.__new__(TritonAttnBackend)
    triton.extend_attention_fwd = own_kernel
    worker = bare(worker_class, ddtree_kernels=Kernels(verify_attention="kernel"),
                  target_worker=SimpleNamespace(model_runner=SimpleNamespace(attn_backend=triton)))
    worker.init_attention_backends()
    assert triton.extend_attention_fwd is not own_kernel
    assert worker.ddtree_kernels.verify_attention == "kernel"

    flashinfer = SimpleNamespace(extend_attention_fwd=own_kernel)
    worker = bare(worker_class, ddtree_kernels=Kernels(verify_attention="kernel"),
                  target_worker=SimpleNamespace(
                      model_runner=SimpleNamespace(attn_backend=flashinfer)))
    worker.init_attention_backends()
    assert flashinfer.extend_attention_fwd is own_kernel
    assert worker.ddtree_kernels.verify_attention == "single"

    triton.extend_attention_fwd = own_kernel
    worker = bare(worker_class, ddtree_kernels=Kernels(verify_attention="single"),
                  target_worker=SimpleNamespace(model_runner=SimpleNamespace(attn_backend=triton)))
    worker.init_attention_backends()
    assert triton.extend_attention_fwd is own_kernel  # the check dropped the kernel


def test_the_largest_batch_is_the_request_pool_s_rows(worker_class, monkeypatch):
    """Sized by the pool SGLang made (a decode graph's larger padded size wins); before the
    pool exists the question is refused, naming the order."""
    runner = SimpleNamespace(req_to_token_pool=None)
    worker = bare(worker_class, target_worker=SimpleNamespace(device="cpu", model_runner=runner))
    with pytest.raises(RuntimeError, match="alloc_memory_pool runs first"):
        worker._max_batch_size()
    runner.req_to_token_pool = SimpleNamespace(req_to_token=torch.zeros(49, 300))
    monkeypatch.setattr(sg, "decode_capture_sizes", lambda r: [1, 2, 4, 8, 16, 32])
    assert worker._max_batch_size() == 49
    monkeypatch.setattr(sg, "decode_capture_sizes", lambda r: [1, 64])
    assert worker._max_batch_size() == 64
