"""Tensor parallelism's draft top-K (sharded_topk.py) in 2 and 4 gloo processes: the merged
top-K and log-probabilities equal the unsharded ones (random logits, ties, uneven and padded
shards), and every rank builds the same tree, the unsharded tree."""
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ddtree_sglang.tree.builder import build_draft_tree
from ddtree_sglang.tree.sharded_topk import VocabShard, canonical_top_log_probs

VOCAB, BUDGET = 211, 24


def cases() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randn(2, 5, VOCAB, generator=g) * 3,
            torch.randn(2, 5, VOCAB, generator=g).round(),  # many ties
            torch.zeros(1, 3, VOCAB)]  # all tied


def bounds(world: int) -> list[tuple[int, int]]:
    """Uneven shards: rank r holds [start, start + valid), every rank padded to the widest."""
    cuts = {2: [0, 131, VOCAB], 4: [0, 17, 90, 160, VOCAB]}[world]
    return [(a, b - a) for a, b in zip(cuts, cuts[1:])]


def worker(rank: int, world: int, port: int, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)

    def gather(t: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(parts, t.contiguous())
        return torch.stack(parts)

    start, valid = bounds(world)[rank]
    width = max(v for _, v in bounds(world))
    shard = VocabShard(start, valid, gather)
    got = []
    for logits in cases():
        local = torch.full((*logits.shape[:-1], width), 7.0)  # padding: never a candidate
        local[..., :valid] = logits[..., start:start + valid]
        lp, ids = shard.top_log_probs(local, BUDGET)
        tree = build_draft_tree(local, BUDGET, top=shard.top_log_probs)
        got.append((lp, ids, tree.tokens, tree.parents, tree.scores))
    out[rank] = got
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_every_rank_merges_the_unsharded_top_k_and_builds_the_unsharded_tree(world):
    port = 29500 + world + os.getpid() % 1000
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(worker, args=(world, port, out), nprocs=world, join=True)
        ranks = [out[r] for r in range(world)]
    for i, logits in enumerate(cases()):
        want_lp, want_ids = canonical_top_log_probs(logits, BUDGET)
        want_tree = build_draft_tree(logits, BUDGET, top=canonical_top_log_probs)
        for rank in ranks:
            lp, ids, tokens, parents, scores = rank[i]
            assert torch.equal(ids, want_ids), (world, i)
            assert torch.allclose(lp, want_lp, atol=1e-5)
            assert torch.equal(tokens, want_tree.tokens) and torch.equal(parents,
                                                                         want_tree.parents)
            assert torch.allclose(scores, want_tree.scores, atol=1e-4)
        for r in ranks[1:]:  # bitwise the same tree on every rank
            assert all(torch.equal(a, b) for a, b in zip(r[i], ranks[0][i]))


def test_canonical_order_breaks_ties_by_token_id():
    logits = torch.tensor([[0.0, 2.0, 2.0, -1.0, 2.0]])
    lp, ids = canonical_top_log_probs(logits, 4)
    assert ids.tolist() == [[1, 2, 4, 0]]
    assert torch.allclose(lp.exp().sum(), torch.softmax(logits, -1)[0, [1, 2, 4, 0]].sum())
