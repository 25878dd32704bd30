"""sglang_plugin/graphed_stages.py on the CPU: the fixed-address buffers, the tree stage's
results as the step reads them, and the accept stage's graphs (stood in by functions that
replay what they captured) over a two-slot ring, padded batch sizes included."""
import functools

import pytest
import torch

pytest.importorskip("sglang")

from ddtree_sglang.kernels.choice import Kernels  # noqa: E402
from ddtree_sglang.sglang_plugin import graphed_stages as gs  # noqa: E402
from ddtree_sglang.sglang_plugin.model_io import draft_logits  # noqa: E402
from ddtree_sglang.tree.stages import commit_stage, accept_stage  # noqa: E402

V, H, BLOCK, B = 30, 8, 4, 8
HEAD = type("Head", (), {"weight": torch.randn(V, H, generator=torch.Generator().manual_seed(0))})


def stages(budgets=(3, 8), max_bs=5) -> gs.GraphedStages:
    return gs.GraphedStages(Kernels(), B, BLOCK - 1, BLOCK,
                            functools.partial(draft_logits, HEAD, vocab_size=V), budgets,
                            max_bs=max_bs, hidden_size=H, graphed=True)


class ReplayedFunction:
    """A stand-in for a captured CUDA graph: replay() runs what was captured."""

    def __init__(self, fn) -> None:
        self.fn, self.replays = fn, 0

    def replay(self) -> None:
        self.replays += 1
        self.fn()


def test_static_outputs_start_well_formed_and_hand_out_views():
    sample = (torch.tensor([[1, 2, 3], [4, 5, 6]]), torch.arange(4))  # [bs, 3] and [bs * 2]
    out = gs.StaticOutputs(sample, max_bs=3)
    assert out.rows == (1, 2)
    assert out.buffers[0].tolist() == [[1, 2, 3]] * 3 and out.buffers[1].tolist() == [0, 1] * 3
    out.write((torch.tensor([[7, 8, 9]]), torch.tensor([5, 6])), 1)
    first, second = out.read(1)
    assert first.tolist() == [[7, 8, 9]] and second.tolist() == [5, 6]
    assert first.data_ptr() == out.buffers[0].data_ptr()  # a view, no copy
    with pytest.raises(ValueError, match="a batch of 4 requests exceeds the 3"):
        out.write(sample, 4)


def test_the_tree_stage_keeps_every_candidate_width_in_its_buffers():
    st = stages()
    hidden = torch.randn(2, BLOCK - 1, H)
    st.tree.run(hidden, torch.tensor([3, 4]), torch.tensor([7, 9]))
    out = st.tree.read(2)
    assert list(out.layouts) == [4, 9] and out.depth_probs.shape == (2, 2, BLOCK - 1)
    assert out.layouts[4].draft_tokens.tolist()[::4] == [3, 4]  # the roots
    assert out.seq_lens.tolist() == [7, 9]
    assert torch.equal(out.layouts[4].tree_parents, out.layouts[9].tree_parents[:, :4])


def run_accept(st, bs, width, choice, slots):
    c, s = st.accept.inputs(bs, width)
    c.copy_(choice)
    s.copy_(slots)
    return st.accept.run(bs, width)


def reference(st, bs, width, choice, slots):
    tree = st.tree.read(bs)
    lay = tree.layouts[width]
    return commit_stage(accept_stage, lay.draft_tokens.view(bs, width), lay.tree_parents,
                        lay.tree_depths, choice, slots.view(bs, width), tree.seq_lens,
                        BLOCK - 1, BLOCK)


def test_graphed_accepts_use_a_two_slot_ring_and_pad_to_a_captured_size(monkeypatch):
    """Batch sizes 2 and 4 are captured: a batch of 3 replays size 4's graph of the same width
    and ring slot, and reads only its own rows; consecutive steps alternate ring slots, so a
    step's results survive the next step."""
    graphs: list[ReplayedFunction] = []
    monkeypatch.setattr(gs, "capture_graph", lambda fn, pool: graphs.append(
        ReplayedFunction(fn)) or graphs[-1])
    monkeypatch.setattr(gs.torch.cuda, "graph_pool_handle", lambda: "pool")
    st = stages()
    st.accept.capture([2, 4])
    assert len(graphs) == 2 * 2 * 2 and st.accept.captured_sizes == [2, 4]
    gen = torch.Generator().manual_seed(1)
    st.tree.run(torch.randn(3, BLOCK - 1, H, generator=gen), torch.tensor([1, 2, 3]),
                torch.tensor([5, 6, 7]))
    choice = torch.randint(0, V, (3, 9), generator=gen)
    slots = torch.arange(27) + 100
    first = run_accept(st, 3, 9, choice, slots)
    want = reference(st, 3, 9, choice, slots)
    got = (*vars(first[0]).values(), *vars(first[1]).values())
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert sum(g.replays for g in graphs) == 1
    kept = first[0].tokens.clone()
    choice2 = torch.randint(0, V, (3, 9), generator=gen)
    second = run_accept(st, 3, 9, choice2, slots)  # the other ring slot
    assert torch.equal(first[0].tokens, kept)  # the first step's results are intact
    assert first[0].tokens.data_ptr() != second[0].tokens.data_ptr()
    third = run_accept(st, 3, 9, choice2, slots)  # back to the first slot
    assert third[0].tokens.data_ptr() == first[0].tokens.data_ptr()
    st.accept.enabled = False  # graphs off: the same results, computed eagerly
    eager = run_accept(st, 3, 9, choice2, slots)
    assert torch.equal(eager[0].tokens, second[0].tokens)


def test_a_batch_larger_than_every_graph_runs_eagerly(monkeypatch):
    monkeypatch.setattr(gs, "capture_graph", lambda fn, pool: ReplayedFunction(fn))
    monkeypatch.setattr(gs.torch.cuda, "graph_pool_handle", lambda: "pool")
    st = stages()
    st.accept.capture([2])
    choice, slots = torch.zeros(5, 4, dtype=torch.long), torch.arange(20)
    commit, _ = run_accept(st, 5, 4, choice, slots)
    assert commit.tokens.shape == (5, BLOCK)
    assert st.accept._captured_size(5, 4, 0) is None and st.accept._captured_size(1, 4, 1) == 2


def test_the_tree_stage_writes_each_width_s_mask_blocks_into_its_backend_buffer():
    """With mask targets set, every tree stage run leaves in each width's buffer exactly the
    ancestor blocks full_mask places (the prefix cells untouched: never read), up to the
    buffer's batch size; the verify takes the buffer only where it holds this step's mask."""
    from ddtree_sglang.tree.verify_layout import full_mask

    st = stages()
    seq = torch.tensor([7, 9])
    buffers = {w: torch.full((4 * w * (20 + w),), 7, dtype=torch.uint8) for w in (4, 9)}
    st.tree.set_mask_targets({4: (buffers[4], 2), 9: (buffers[9], 2), 200: (buffers[9], 2)})
    assert sorted(st.tree.mask_targets) == [4, 9]  # no positions at an unknown width
    st.tree.run(torch.randn(2, BLOCK - 1, H), torch.tensor([3, 4]), seq)
    out = st.tree.read(2)
    for w, buf in buffers.items():
        want = full_mask(out.layouts[w].ancestors, seq, 20)
        blocks = out.mask_positions[w].reshape(-1)
        assert torch.equal(buf[blocks], want[blocks].to(torch.uint8))
        untouched = torch.ones_like(buf, dtype=torch.bool)
        untouched[blocks] = False
        assert (buf[untouched] == 7).all()  # only the blocks were written
    assert st.tree.mask_buffer(9, 2) is buffers[9] and st.tree.mask_buffer(9, 3) is None
    assert stages().tree.mask_buffer(9, 1) is None  # no target: the verify builds the mask
