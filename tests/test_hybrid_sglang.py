"""sglang_plugin/hybrid.py against SGLang 0.5.17's own hybrid backend code, on the CPU.

* In process: SGLang's MambaAttnBackendBase metadata (eager and CUDA-graph buffers) gets our
  layout's links only once the linear half's topk is raised (raise_topk stands in for the
  patches.py write the wiring adds); the commit hands the backend the node's
  index SGLang's EAGLE commit computes; SGLang's own scatter orchestration (its CUDA kernels
  swapped for ports of their documented semantics) leaves the toy state of test_hybrid.py
  fed token by token; pool_problems on SGLang's pool layouts.
* In a Triton-interpreter subprocess (this file run as a script): SGLang's tree conv and
  gated-delta verify kernels on DDTree layouts, our commit through SGLang's backend method,
  then the same kernels run as a plain chain over the committed tokens: same states, same
  outputs along the path.
"""

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sglang = pytest.importorskip("sglang")

from ddtree_sglang.sglang_plugin import hybrid, sglang_api as sg  # noqa: E402
from ddtree_sglang.tree.verify_layout import VerifyLayout, full_mask  # noqa: E402
from test_hybrid import (P, choices_along_children, commit_of, fed, kernel_parents,  # noqa: E402
                         tree_states, trees)

HYBRID_NAMES = ("HybridLinearAttnBackend", "GDNAttnBackend")


def sglang_names():
    """The SGLang classes hybrid.py reads as sg.<name> (sglang_api gains them with the wiring)."""
    from sglang.srt.layers.attention.hybrid_linear_attn_backend import HybridLinearAttnBackend
    from sglang.srt.layers.attention.linear.gdn_backend import GDNAttnBackend

    return {"HybridLinearAttnBackend": HybridLinearAttnBackend, "GDNAttnBackend": GDNAttnBackend}


@pytest.fixture
def names(monkeypatch):
    found = sglang_names()
    for name, obj in found.items():
        monkeypatch.setattr(sg, name, obj, raising=False)
    return found


class FakeReqPool:
    """Request row -> recurrent state slot (identity translation, as SGLang's static pool)."""

    def __init__(self, slots: torch.Tensor, cache=None, mamba_pool=None) -> None:
        self.slots, self.cache = slots, cache
        self.mamba_pool = mamba_pool or SimpleNamespace(replayssm_is_kda=False,
                                                        enable_linear_replayssm=False)

    def get_mamba_indices(self, req_pool_indices: torch.Tensor) -> torch.Tensor:
        return self.slots[req_pool_indices.long()].to(torch.int32)

    def translate_mamba_indices(self, indices: torch.Tensor) -> torch.Tensor:
        return indices

    def get_speculative_mamba2_params_all_layers(self):
        return self.cache


def gdn_linear_backend(names, pool: FakeReqPool, topk: int | None = 1):
    """A GDNAttnBackend with only its base class's state (what the verify metadata, the graph
    buffers and the commit read), built by SGLang's own MambaAttnBackendBase.__init__."""
    from sglang.srt.layers.attention.hybrid_linear_attn_backend import MambaAttnBackendBase

    runner = SimpleNamespace(
        server_args=SimpleNamespace(speculative_eagle_topk=topk, enable_unified_memory=False),
        device="cpu", is_draft_worker=False, req_to_token_pool=pool, token_to_kv_pool=None)
    linear = names["GDNAttnBackend"].__new__(names["GDNAttnBackend"])
    MambaAttnBackendBase.__init__(linear, runner)
    linear.needs_cpu_seq_lens = False
    return linear


def hybrid_backend(names, linear):
    full = SimpleNamespace(token_to_kv_pool=None, req_to_token_pool=None, max_context_len=None,
                           needs_cpu_seq_lens=False, name="full")
    return names["HybridLinearAttnBackend"](full, linear, [1])


def raise_topk(attn_backend) -> None:
    """What the wiring's patches.py write does to a hybrid target's verify backend: the linear
    half hybrid.tree_verify_backend names gets topk = TREE_TOPK."""
    linear = hybrid.tree_verify_backend(attn_backend)
    linear.topk = hybrid.TREE_TOPK


def verify_input(lay: VerifyLayout, seq_lens: torch.Tensor):
    """The EagleVerifyInput DFlashModelIO.target_verify builds for a layout."""
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
    from sglang.srt.speculative.eagle_info import EagleVerifyInput

    n = lay.num_tokens_per_req
    return EagleVerifyInput(
        draft_token=lay.draft_tokens, custom_mask=full_mask(lay.ancestors, seq_lens,
                                                            int(seq_lens.sum())),
        positions=lay.positions, retrieve_index=lay.retrieve_index,
        retrieve_next_token=lay.retrieve_next_token,
        retrieve_next_sibling=lay.retrieve_next_sibling, retrieve_cum_len=None, spec_steps=6,
        topk=1, draft_token_num=n, capture_hidden_mode=CaptureHiddenMode.FULL,
        seq_lens_sum=None, seq_lens_cpu=None)


def verify_batch(lay: VerifyLayout, spec_info, req_pool_indices: torch.Tensor):
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    return SimpleNamespace(batch_size=len(req_pool_indices), req_pool_indices=req_pool_indices,
                           forward_mode=ForwardMode.TARGET_VERIFY, spec_info=spec_info,
                           input_ids=lay.draft_tokens, mamba_track_indices=None,
                           mamba_track_mask=None, _original_batch_size=None)


def test_eager_verify_gets_the_links_once_tree_verify_is_on(names):
    lay = trees(3, "builder", 3, 12)
    pool = FakeReqPool(torch.tensor([7, 2, 5, 0]))
    linear = gdn_linear_backend(names, pool)
    backend = hybrid_backend(names, linear)
    seq_lens = lay.positions.view(3, -1)[:, 0]
    batch = verify_batch(lay, verify_input(lay, seq_lens), torch.tensor([2, 0, 1]))
    before = linear._forward_metadata(batch)
    assert before.retrieve_next_token is None and before.retrieve_parent_token is None
    assert not hybrid.tree_links_on(backend)
    raise_topk(backend)
    assert hybrid.tree_links_on(backend)
    meta = linear._forward_metadata(batch)
    assert meta.retrieve_next_token is lay.retrieve_next_token
    assert meta.retrieve_next_sibling is lay.retrieve_next_sibling
    assert meta.retrieve_parent_token.shape == lay.tree_parents.shape  # filled by the conv kernel
    assert meta.mamba_cache_indices.tolist() == [5, 7, 2]
    n = lay.num_tokens_per_req
    assert meta.query_start_loc.tolist() == [0, n, 2 * n, 3 * n]


def test_graph_buffers_bound_at_capture_and_filled_at_replay(names):
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    lay = trees(5, "random", 3, 10)
    n = lay.num_tokens_per_req
    pool = FakeReqPool(torch.tensor([7, 2, 5, 0]))
    seq_lens = lay.positions.view(3, -1)[:, 0]
    spec = verify_input(lay, seq_lens)

    chain = gdn_linear_backend(names, pool)  # the links are not bound: a graph captured now
    chain.init_cuda_graph_state(4, 4 * n)  # would scan every tree as a chain
    assert chain._capture_metadata(4, torch.zeros(4, dtype=torch.long),
                                   ForwardMode.TARGET_VERIFY, None).retrieve_next_token is None

    linear = gdn_linear_backend(names, pool)
    raise_topk(hybrid_backend(names, linear))
    linear.init_cuda_graph_state(4, 4 * n)  # a graph of 4 requests, this step has 3
    captured = linear._capture_metadata(4, torch.zeros(4, dtype=torch.long),
                                        ForwardMode.TARGET_VERIFY, None)
    replay = linear._replay_metadata(4, torch.tensor([2, 0, 1, 3]), ForwardMode.TARGET_VERIFY,
                                     spec, torch.tensor([9, 9, 9, 1]), num_padding=1)
    for name in ("retrieve_next_token", "retrieve_next_sibling", "retrieve_parent_token"):
        assert getattr(replay, name).data_ptr() == getattr(captured, name).data_ptr(), name
    assert torch.equal(replay.retrieve_next_token[:3].long(), lay.retrieve_next_token)
    assert torch.equal(replay.retrieve_next_sibling[:3].long(), lay.retrieve_next_sibling)
    assert replay.mamba_cache_indices.tolist() == [5, 7, 2, -1]  # the padding row is skipped


def test_tree_verify_backend_leaves_other_targets_alone_and_refuses_other_layers(names):
    plain = SimpleNamespace(name="plain", topk=1)
    assert hybrid.tree_verify_backend(plain) is None and hybrid.tree_links_on(plain)
    assert hybrid.linear_backend(plain) is None
    assert sg.full_attention_backend(plain) is plain
    linear = gdn_linear_backend(names, FakeReqPool(torch.arange(2)), topk=None)
    backend = hybrid_backend(names, linear)
    assert sg.full_attention_backend(backend).name == "full"
    assert hybrid.tree_verify_backend(backend) is linear and not hybrid.tree_links_on(backend)
    other = SimpleNamespace(needs_cpu_seq_lens=False, topk=2)
    with pytest.raises(RuntimeError, match="gated-delta"):
        hybrid.tree_verify_backend(hybrid_backend(names, other))


def dedup_windows(layers: int, slots: int, steps: int, dim: int, win: int) -> torch.Tensor:
    """SGLang's shared conv-window layout for chains (memory_pool.py:417-455), on the CPU:
    step t's window is columns t..t+win-1 of one [dim, steps + win - 1] buffer."""
    phys = torch.zeros(layers, slots, dim, steps + win - 1)
    s = phys.stride()
    return phys.as_strided((layers, slots, steps, dim, win), (s[0], s[1], s[3], s[2], s[3]))


def pool_cache(steps: int, windows: torch.Tensor, ssm: bool = True):
    return SimpleNamespace(intermediate_ssm=torch.zeros(2, 5, steps, 2, 4, 4) if ssm else None,
                           intermediate_conv_window=[windows])


def test_pool_problems():
    dense = torch.zeros(2, 5, 9, 16, 3)
    assert hybrid.pool_problems(FakeReqPool(torch.arange(4), pool_cache(9, dense)), 9) == []
    few = hybrid.pool_problems(FakeReqPool(torch.arange(4), pool_cache(8, dense)), 9)
    assert len(few) == 1 and "keeps 8 verify steps" in few[0]
    shared = hybrid.pool_problems(FakeReqPool(torch.arange(4),
                                              pool_cache(9, dedup_windows(2, 5, 9, 16, 3))), 9)
    assert len(shared) == 1 and "share memory" in shared[0]
    ring = hybrid.pool_problems(FakeReqPool(torch.arange(4), pool_cache(9, dense, ssm=False)), 9)
    assert len(ring) == 1 and "ReplaySSM" in ring[0]
    fold = FakeReqPool(torch.arange(4), pool_cache(9, dense),
                       SimpleNamespace(replayssm_spec_fold=True))
    assert "ReplaySSM" in hybrid.pool_problems(fold, 9)[0]


class RecordingBackend:
    def __init__(self) -> None:
        self.calls: list[dict] = []

    def update_mamba_state_after_mtp_verify(self, **kwargs) -> None:
        self.calls.append(kwargs)


@pytest.mark.parametrize("seed", range(8))
def test_commit_hands_the_backend_what_sglangs_eagle_commit_computes(seed, monkeypatch):
    from sglang.srt.speculative import spec_utils

    bs = 2 + seed % 3
    lay = trees(seed, "builder" if seed % 2 else "random", bs, 6 + 3 * seed)
    n = lay.num_tokens_per_req
    commit = commit_of(lay, choices_along_children(lay, seed, 0.9), int(lay.tree_depths.max()))
    seq_lens = lay.positions.view(bs, n)[:, 0]
    interval = n + seed % 4
    monkeypatch.setattr(spec_utils, "get_exec", lambda: SimpleNamespace(
        mamba=SimpleNamespace(mamba_track_interval=interval)))
    for tracked in (None, torch.arange(100, 100 + bs)):
        batch = SimpleNamespace(seq_lens=seq_lens, req_pool_indices=torch.arange(bs) + 3,
                                mamba_track_indices=tracked)
        backend = RecordingBackend()
        hybrid.commit_recurrent_state(backend, "model", batch, commit, n, interval)
        (call,) = backend.calls
        last, track = spec_utils._verify_commit_step_indices(
            batch=batch, accept_index=commit.accept_index, accept_lens=commit.commit_lens,
            draft_token_num=n)
        assert torch.equal(call["last_correct_step_indices"], last.long())
        assert call["mamba_track_indices"] is tracked and call["model"] == "model"
        assert torch.equal(call["req_pool_indices"], batch.req_pool_indices)
        if tracked is None:
            assert call["mamba_steps_to_track"] is None and track is None
        else:
            assert torch.equal(call["mamba_steps_to_track"], track.long())


def test_commit_without_the_track_interval_is_refused():
    lay = trees(1, "builder", 2, 8)
    commit = commit_of(lay, choices_along_children(lay, 1), int(lay.tree_depths.max()))
    batch = SimpleNamespace(seq_lens=torch.tensor([3, 4]), req_pool_indices=torch.arange(2),
                            mamba_track_indices=torch.arange(2))
    with pytest.raises(ValueError, match="track interval"):
        hybrid.commit_recurrent_state(RecordingBackend(), None, batch, commit, 9, None)


def scatter_port(dst: torch.Tensor, src: torch.Tensor, dst_indices: torch.Tensor,
                 steps: torch.Tensor) -> None:
    """SGLang's fused state / conv-window scatters as documented (mamba_state_scatter_triton.py:
    202-223, 375-389): for each request i with steps[i] >= 0,
    dst[:, dst_indices[i]] = src[:, i, steps[i]]."""
    for i in range(steps.shape[0]):
        if int(steps[i]) >= 0:
            dst[:, int(dst_indices[i])] = src[:, i, int(steps[i])]


def use_scatter_ports(monkeypatch) -> None:
    import sglang.kernels.ops.mamba.mamba_state_scatter_triton as scatter

    monkeypatch.setattr(scatter, "fused_mamba_state_scatter_with_mask", scatter_port)
    monkeypatch.setattr(scatter, "fused_conv_window_scatter_with_mask", scatter_port)


@pytest.mark.parametrize("seed", range(6))
def test_commit_through_sglangs_backend_leaves_the_token_by_token_state(seed, names, monkeypatch):
    """Toy states in SGLang's pool layout: intermediate[layer, row b, node i] = the state after
    node i (what the tree verify writes); after our commit through SGLang's
    HybridLinearAttnBackend.update_mamba_state_after_mtp_verify, each request's slot holds the
    state after its committed tokens fed one by one, and the track slot the prefix state."""
    use_scatter_ports(monkeypatch)
    bs = 3
    lay = trees(seed, "builder", bs, 14)
    n = lay.num_tokens_per_req
    tokens = lay.draft_tokens.view(bs, n)
    h0 = torch.randint(0, P, (bs,), generator=torch.Generator().manual_seed(seed))
    states = tree_states(tokens, kernel_parents(lay.retrieve_next_token,
                                                lay.retrieve_next_sibling), h0)
    slots = torch.tensor([6, 1, 4])
    track_slots = torch.tensor([0, 2, 3])
    cache = SimpleNamespace(temporal=torch.full((1, 8), -1, dtype=torch.long),
                            intermediate_ssm=torch.zeros(1, 9, n, dtype=torch.long),
                            conv=[torch.full((1, 8), -1, dtype=torch.long)],
                            intermediate_conv_window=[torch.zeros(1, 9, n, dtype=torch.long)])
    cache.intermediate_ssm[0, :bs] = states  # row b = the request's place in the batch
    cache.intermediate_conv_window[0][0, :bs] = states
    pool = FakeReqPool(slots, cache)
    linear = gdn_linear_backend(names, pool)
    linear.forward_metadata = SimpleNamespace(mamba_cache_indices=slots.to(torch.int32))
    backend = hybrid_backend(names, linear)
    commit = commit_of(lay, choices_along_children(lay, seed, 0.95), int(lay.tree_depths.max()))
    seq_lens = lay.positions.view(bs, n)[:, 0]
    interval = n
    batch = SimpleNamespace(seq_lens=seq_lens, req_pool_indices=torch.arange(bs),
                            mamba_track_indices=track_slots)
    hybrid.commit_recurrent_state(backend, None, batch, commit, n, interval)
    for b in range(bs):
        k, pre = int(commit.commit_lens[b]), int(seq_lens[b])
        kept = [int(tokens[b, 0])] + commit.tokens[b, :k - 1].tolist()
        for held in (cache.temporal, cache.conv[0]):
            assert int(held[0, slots[b]]) == fed(int(h0[b]), kept)
            crossing = [p for p in range(pre + 1, pre + k + 1) if p % interval == 0]
            expected = fed(int(h0[b]), kept[:crossing[0] - pre]) if crossing else -1
            assert int(held[0, track_slots[b]]) == expected


def test_sglang_tree_kernels_under_the_triton_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "HYBRID KERNELS OK" in proc.stdout


# -- the interpreter check (this file run as a script, TRITON_INTERPRET=1) -----------------------
H, HV, DK, DV, WIDTH = 1, 2, 16, 16, 4  # one gated-delta layer: key heads, value heads, dims, conv
DIM = 2 * H * DK + HV * DV


def conv(x, state, weight, **kw):
    from sglang.kernels.ops.mamba.causal_conv1d_triton import causal_conv1d_update

    return causal_conv1d_update(x, state, weight, None, "silu", **kw)


def gdn(qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, params: dict, ssm: torch.Tensor,
        slots: torch.Tensor, per_request: int, **kw) -> torch.Tensor:
    """The gated-delta verify as gdn_backend.forward_extend runs it (Triton kernel)."""
    from sglang.kernels.ops.attention.fla.fused_sigmoid_gating_recurrent import (
        fused_sigmoid_gating_delta_rule_update)

    t = qkv.shape[0]
    q, k, v = torch.split(qkv, [H * DK, H * DK, HV * DV], dim=-1)
    return fused_sigmoid_gating_delta_rule_update(
        A_log=params["A_log"], a=a, dt_bias=params["dt_bias"], softplus_beta=1.0,
        softplus_threshold=20.0, q=q.reshape(1, t, H, DK), k=k.reshape(1, t, H, DK),
        v=v.reshape(1, t, HV, DV), b=b, initial_state_source=ssm, initial_state_indices=slots,
        cu_seqlens=torch.arange(0, t + 1, per_request, dtype=torch.int32),
        use_qk_l2norm_in_kernel=True, **kw)


def interpreted_case(seed: int, kind: str, bs: int, budget: int) -> None:
    from sglang.srt.layers.attention.hybrid_linear_attn_backend import HybridLinearAttnBackend
    from sglang.srt.layers.attention.linear.gdn_backend import GDNAttnBackend

    from ddtree_sglang.tree.hybrid import retrieve_parent_token

    g = torch.Generator().manual_seed(seed)
    lay = trees(seed, kind, bs, budget)
    n = lay.num_tokens_per_req
    tokens = lay.draft_tokens.view(bs, n)
    vocab = int(tokens.max()) + 1
    table = {"qkv": torch.randn(vocab, DIM, generator=g), "a": torch.randn(vocab, HV, generator=g),
             "b": torch.randn(vocab, HV, generator=g)}
    params = {"weight": torch.randn(DIM, WIDTH, generator=g) * 0.5,
              "A_log": torch.randn(HV, generator=g) * 0.3, "dt_bias": torch.randn(HV, generator=g)}
    pool_slots = bs + 3
    conv0 = torch.randn(pool_slots, DIM, WIDTH - 1, generator=g)
    ssm0 = torch.randn(pool_slots, HV, DV, DK, generator=g) * 0.3
    slots = torch.randperm(pool_slots, generator=g)[:2 * bs].to(torch.int32)
    slots, track_slots = slots[:bs], slots[bs:]
    rows = torch.arange(bs, dtype=torch.int32)

    # the tree verify, as SGLang's GDN backend runs it (gdn_backend.py:533-551, :641-665)
    cache = SimpleNamespace(temporal=ssm0.clone()[None], conv=[conv0.clone()[None]],
                            intermediate_ssm=torch.zeros(1, bs + 1, n, HV, DV, DK),
                            intermediate_conv_window=[torch.zeros(1, bs + 1, n, DIM, WIDTH - 1)])
    parents = torch.empty_like(lay.retrieve_next_token)
    x = table["qkv"][tokens]  # [bs, n, DIM]
    mixed = conv(x.transpose(1, 2), cache.conv[0][0], params["weight"], conv_state_indices=slots,
                 intermediate_conv_window=cache.intermediate_conv_window[0][0],
                 intermediate_state_indices=rows, retrieve_next_token=lay.retrieve_next_token,
                 retrieve_next_sibling=lay.retrieve_next_sibling, retrieve_parent_token=parents)
    assert torch.equal(parents, retrieve_parent_token(lay.tree_parents)), (parents, lay.tree_parents)
    out = gdn(mixed.transpose(1, 2).reshape(bs * n, DIM), table["a"][tokens].view(-1, HV),
              table["b"][tokens].view(-1, HV), params, cache.temporal[0], slots, n,
              disable_state_update=True, intermediate_states_buffer=cache.intermediate_ssm[0],
              intermediate_state_indices=rows, cache_steps=n, retrieve_parent_token=parents)
    assert torch.equal(cache.temporal[0], ssm0)  # a verify leaves the committed states alone

    # the commit, through SGLang's backend method
    choice = choices_along_children(lay, seed, 0.9)
    commit = commit_of(lay, choice, int(lay.tree_depths.max()))
    seq_lens = lay.positions.view(bs, n)[:, 0]
    interval = n
    linear = GDNAttnBackend.__new__(GDNAttnBackend)
    linear.needs_cpu_seq_lens = False
    linear.req_to_token_pool = FakeReqPool(slots, cache)
    linear.forward_metadata = SimpleNamespace(mamba_cache_indices=slots)
    full = SimpleNamespace(token_to_kv_pool=None, req_to_token_pool=None, max_context_len=None,
                           needs_cpu_seq_lens=False)
    batch = SimpleNamespace(seq_lens=seq_lens, req_pool_indices=torch.arange(bs),
                            mamba_track_indices=track_slots)
    hybrid.commit_recurrent_state(HybridLinearAttnBackend(full, linear, []), None, batch, commit,
                                  n, interval)

    # the same kernels as a plain chain over each request's committed tokens
    for b in range(bs):
        k, pre = int(commit.commit_lens[b]), int(seq_lens[b])
        path = (commit.feature_rows[b, :k] - b * n).tolist()
        kept = tokens[b, path]
        conv_chain, ssm_chain = conv0.clone(), ssm0.clone()
        windows = torch.zeros(1, k, DIM, WIDTH - 1)
        states = torch.zeros(1, k, HV, DV, DK)
        one = slots[b:b + 1]
        chain_mixed = conv(table["qkv"][kept].T[None], conv_chain, params["weight"],
                           conv_state_indices=one, intermediate_conv_window=windows,
                           intermediate_state_indices=torch.zeros(1, dtype=torch.int32))
        chain_out = gdn(chain_mixed[0].T.contiguous(), table["a"][kept], table["b"][kept], params,
                        ssm_chain, one, k, intermediate_states_buffer=states,
                        intermediate_state_indices=torch.zeros(1, dtype=torch.int32),
                        cache_steps=k)
        slot = int(slots[b])
        close = dict(atol=1e-5, rtol=1e-5)
        assert torch.allclose(cache.temporal[0, slot], ssm_chain[slot], **close), (seed, b)
        assert torch.allclose(cache.conv[0][0, slot], conv_chain[slot], **close), (seed, b)
        tree_rows = torch.tensor(path) + b * n
        assert torch.allclose(out[0, tree_rows], chain_out[0], **close), (seed, b)  # the logits' input
        assert torch.allclose(mixed[b][:, path], chain_mixed[0], **close)
        crossing = [p for p in range(pre + 1, pre + k + 1) if p % interval == 0]
        if crossing:
            j, track = crossing[0] - pre - 1, int(track_slots[b])
            assert torch.allclose(cache.temporal[0, track], states[0, j], **close)
            assert torch.allclose(cache.conv[0][0, track], windows[0, j], **close)


def interpreted_check() -> int:
    import sglang.kernels.ops.mamba.mamba_state_scatter_triton as scatter

    # SGLang's scatters are CUDA-only (they check the device); the rest runs in the interpreter
    scatter.fused_mamba_state_scatter_with_mask = scatter_port
    scatter.fused_conv_window_scatter_with_mask = scatter_port
    cases = [(0, "builder", 2, 12), (1, "random", 3, 9), (2, "builder", 1, 20),
             (3, "random", 2, 15), (4, "builder", 3, 6)]
    for case in cases:
        interpreted_case(*case)
    return len(cases)


if __name__ == "__main__":
    print("HYBRID KERNELS OK", interpreted_check())


def test_sglang_reads_the_hybrid_testbed_as_a_gated_delta_target(hybrid_testbed):
    """SGLang's own config class and model class for testbed_hybrid/target: a Qwen3-Next
    model whose gated-delta layers sit where transformers puts them (SGLang places them by
    full_attention_interval, not layer_types), with the rotary and expert settings the
    carry-over relies on, a model class that captures a DFlash drafter's features, and
    weights under the names its loader maps."""
    import json

    from safetensors import safe_open
    from sglang.srt.configs.hybrid_arch import hybrid_gdn_config
    from sglang.srt.configs.qwen3_next import Qwen3NextConfig
    from sglang.srt.models.qwen3_next import EntryClass

    raw = json.loads((hybrid_testbed / "target" / "config.json").read_text())
    cfg = Qwen3NextConfig(**{k: v for k, v in raw.items() if k != "model_type"})
    kinds = raw["layer_types"]
    assert cfg.full_attention_layer_ids == [i for i, k in enumerate(kinds) if k == "full_attention"]
    assert cfg.linear_layer_ids == [i for i, k in enumerate(kinds) if k == "linear_attention"]
    assert cfg.linear_layer_ids and cfg.full_attention_layer_ids
    assert (cfg.partial_rotary_factor, cfg.num_experts, cfg.num_experts_per_tok) == (1.0, 1, 1)
    assert not cfg.tie_word_embeddings
    assert EntryClass.__name__ == raw["architectures"][0]
    assert hasattr(EntryClass, "set_dflash_layers_to_capture")
    assert hybrid_gdn_config(SimpleNamespace(hf_config=cfg)) is cfg
    with safe_open(str(hybrid_testbed / "target" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "lm_head.weight" in names
    assert {n.split(".", 3)[3] for n in names if n.startswith("model.layers.0.")} >= {
        "linear_attn.in_proj_qkvz.weight", "linear_attn.in_proj_ba.weight",
        "linear_attn.conv1d.weight", "linear_attn.A_log", "linear_attn.dt_bias",
        "mlp.experts.0.gate_proj.weight", "mlp.shared_expert.down_proj.weight"}
