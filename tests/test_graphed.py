import torch

from ddtree_sglang.kernels.graphed import GraphedFunction
from ddtree_sglang.tree.builder import build_draft_tree


def test_falls_back_to_eager_on_cpu():
    calls = []

    def fn(x):
        calls.append(1)
        t = build_draft_tree(x, 8)
        return t.tokens, t.parents

    g = GraphedFunction(fn, "test")
    x = torch.randn(2, 5, 11)
    a = g(x)
    b = fn(x)
    assert all(torch.equal(p, q) for p, q in zip(a, b)) and len(calls) == 2
    assert g._graphs == {}  # nothing captured off the GPU


def test_a_padded_replay_repeats_the_first_row_and_returns_only_the_real_rows():
    """A batch of 3 replayed on the graph captured for 4: the padding row repeats row 0 (a
    valid input), and each output keeps the first 3 rows (or 3 * k of a flattened one)."""
    def fn(x, y):
        return (x * 2 + y, (x + y).repeat_interleave(2, dim=0))  # [bs, 2], [bs * 2, 2]

    static_in = [torch.full((4, 2), -1.0), torch.full((4, 2), -1.0)]
    static_out = [torch.zeros(4, 2), torch.zeros(8, 2)]

    class FakeGraph:  # what a CUDA graph does on replay: fn over the static buffers
        def replay(self):
            for dst, src in zip(static_out, fn(*static_in)):
                dst.copy_(src)

    x, y = torch.arange(6.0).view(3, 2), torch.ones(3, 2)
    out = GraphedFunction._replay((FakeGraph(), static_in, static_out), (x, y), 3, 4)
    want = fn(x, y)
    assert all(torch.equal(a, b) for a, b in zip(out, want))
    assert torch.equal(static_in[0][3], x[0]) and torch.equal(static_in[1][3], y[0])
    assert out[0].data_ptr() != static_out[0].data_ptr()  # the caller owns a copy
