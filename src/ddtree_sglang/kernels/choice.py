"""Which kernels a decode step runs, decided once at startup.

Every Triton kernel of the step has a PyTorch reference.  `choose_kernels` runs each kernel once
on this device against its reference (the tree builder, the draft top-k, the logsumexp, the
acceptance walk, the KV move and, through a check the engine passes, the verify attention) and
returns one frozen `Kernels`: what the step uses, and why each kernel that is not used was
dropped.  A kernel that fails or disagrees is never fatal: its reference serves instead.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch

from ddtree_sglang.tree.stages import accept_stage
from ddtree_sglang.tree.draft_tree import DraftTree, torch_top_log_probs
from ddtree_sglang.tree.sharded_topk import VocabShard
from ddtree_sglang.tree.builder import build_draft_tree

# The one-pass Triton top-k extracts k values from every 4,096-logit chunk by repeated max,
# work that grows with rows x k; PyTorch's radix top-k is faster on many rows (the profile in
# benchmarks/results/ measured both).  Rows = batch x draft depth; 256 is the cut.
TOPK_MAX_ROWS = 256
# The fused tree kernel's limits (kernels/tree_build.py).
TREE_KERNEL_MAX_BUDGET, TREE_KERNEL_MAX_DEPTH = 256, 16


@dataclass(frozen=True)
class Kernels:
    """The kernels of one worker's decode step.  The defaults are the PyTorch references.

    tree_builder: "triton" (fused, kernels/tree_build.py) or "torch" (tree/builder.py).
    accept: "triton" (kernels/accept.py) or "torch" (tree/stages.accept_stage).
    topk / logsumexp: the draft top-k's Triton kernels (kernels/topk.py, kernels/logsumexp.py).
    kv_move: the Triton KV move (kernels/kv_move.py); else the engine's generic move.
    verify_attention: "kernel" (kernels/tree_attention.py, installed by the SGLang plugin) or
        "single" (the engine's own masked attention call).
    dropped: (kernel, why it is not used) for each kernel that failed its check.
    """

    tree_builder: str = "torch"
    accept: str = "torch"
    topk: bool = False
    logsumexp: bool = False
    kv_move: bool = False
    verify_attention: str = "single"
    dropped: tuple[tuple[str, str], ...] = ()
    vocab_shard: VocabShard | None = None  # tensor parallelism: this rank's vocabulary slice

    def top_log_probs(self, draft_logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """draft_tree.TopLogProbs through the kernels this set uses (over every rank's shard,
        merged exactly, where the vocabulary is split: sharded_topk.py)."""
        if self.vocab_shard is not None:
            return self.vocab_shard.top_log_probs(draft_logits, k)
        rows = draft_logits.numel() // draft_logits.shape[-1]
        if self.topk and draft_logits.is_cuda and rows <= TOPK_MAX_ROWS:
            from ddtree_sglang.kernels.topk import MAX_K, top_log_probs_triton

            if k <= MAX_K:
                return top_log_probs_triton(draft_logits, k)
        if not (self.logsumexp and draft_logits.is_cuda):
            return torch_top_log_probs(draft_logits, k)
        from ddtree_sglang.kernels.logsumexp import logsumexp_triton

        values, ids = torch.topk(draft_logits, k, dim=-1)
        return values.float() - logsumexp_triton(draft_logits).unsqueeze(-1), ids

    def build_tree(self, draft_logits: torch.Tensor, budget: int) -> DraftTree:
        """The B-best tree of every request (tree.builder.build_draft_tree's contract)."""
        if self.tree_builder == "triton":
            from ddtree_sglang.kernels.tree_build import build_draft_tree_triton

            return build_draft_tree_triton(draft_logits, budget, top=self.top_log_probs)
        return build_draft_tree(draft_logits, budget, top=self.top_log_probs)

    @property
    def accept_stage(self) -> Callable[..., tuple]:
        """tree.stages.accept_stage or its one-launch Triton twin (same arguments, outputs)."""
        if self.accept == "triton":
            from ddtree_sglang.kernels.accept import accept_stage_triton

            return accept_stage_triton
        return accept_stage

    def move_kv_rows(self, data_ptrs: torch.Tensor, strides: torch.Tensor, max_stride: int,
                     tgt: torch.Tensor, src: torch.Tensor) -> None:
        """The Triton KV move (kernels/kv_move.py), where `kv_move` holds."""
        from ddtree_sglang.kernels.kv_move import move_rows_triton

        move_rows_triton(data_ptrs, strides, max_stride, tgt, src)

    def describe(self) -> str:
        """One log line's worth: what is used, and what was dropped and why."""
        used = (f"tree builder {self.tree_builder}, acceptance {self.accept}, top-k "
                f"{'triton' if self.topk else 'torch'}, logsumexp "
                f"{'triton' if self.logsumexp else 'torch'}, KV move "
                f"{'triton' if self.kv_move else 'engine'}, verify attention "
                f"{self.verify_attention}")
        if self.vocab_shard is not None:
            used += (f", top-k merged over the tensor-parallel vocabulary shards (this rank's: "
                     f"{self.vocab_shard.valid} ids from {self.vocab_shard.start})")
        return used + "".join(f"; {name} not used: {why}" for name, why in self.dropped)


def choose_kernels(*, tree_kernel: str, budget: int, depth: int, vocab: int, out_width: int,
                   device, dtype: torch.dtype, verify_attention: str = "single",
                   check_verify_attention: Callable[[str], str | None] | None = None) -> Kernels:
    """Check every kernel on `device` once and return the set to use.

    tree_kernel: "auto" (the fused builder where it fits) or "torch".
    verify_attention: the asked variant; `check_verify_attention(variant)` says why it cannot
    be used (None: it can), the engine's comparison with its own attention kernel."""
    if torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return Kernels()
    dropped: list[tuple[str, str]] = []

    def keep(name: str, why: str | None) -> bool:
        if why is not None:
            dropped.append((name, why))
        return why is None

    k = min(budget, vocab)
    topk = keep("Triton top-k", _check(lambda: _topk_agrees(vocab, k, device, dtype)))
    lse = keep("Triton logsumexp", _check(lambda: _logsumexp_agrees(vocab, device, dtype)))
    chosen = Kernels(topk=topk, logsumexp=lse)
    builder = "torch"
    if tree_kernel == "auto" and budget <= TREE_KERNEL_MAX_BUDGET \
            and depth <= TREE_KERNEL_MAX_DEPTH:
        fused = replace(chosen, tree_builder="triton")
        if keep("fused tree kernel", check_builder(fused, chosen, budget, depth, vocab, device,
                                                   dtype)):
            builder = "triton"
    accept = "triton" if keep("fused acceptance", check_accept_kernel(device, depth,
                                                                      out_width)) else "torch"
    kv_move = keep("Triton KV move", check_kv_move_kernel(device))
    variant = verify_attention
    if variant != "single" and check_verify_attention is not None:
        if not keep(f"{variant} verify attention", check_verify_attention(variant)):
            variant = "single"
    return Kernels(tree_builder=builder, accept=accept, topk=topk, logsumexp=lse,
                   kv_move=kv_move, verify_attention=variant, dropped=tuple(dropped))


def _check(agrees: Callable[[], bool]) -> str | None:
    """Run a comparison: None if it agrees, else why not (a failure counts as a no)."""
    try:
        return None if agrees() else "it disagrees with its PyTorch reference"
    except Exception as exc:  # noqa: BLE001 - any failure means: do not use it
        return f"{type(exc).__name__}: {str(exc)[:200]}"


def _topk_agrees(vocab: int, k: int, device, dtype: torch.dtype) -> bool:
    """The Triton top-k against torch.topk + logsumexp, ties included."""
    from ddtree_sglang.kernels.topk import MAX_K, is_valid_top_k, top_log_probs_triton

    if k > MAX_K:
        return True  # not used for this budget: torch.topk serves it
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn((3, 2, vocab), generator=gen, device=device).mul(4).to(dtype)
    x[1, 1] = x[1, 1].round()  # many exactly equal logits
    return is_valid_top_k(x, k, *top_log_probs_triton(x, k))


def _logsumexp_agrees(vocab: int, device, dtype: torch.dtype) -> bool:
    from ddtree_sglang.kernels.logsumexp import logsumexp_triton

    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn((3, vocab), generator=gen, device=device).mul(4).to(dtype)
    return torch.allclose(logsumexp_triton(x), torch.logsumexp(x.float(), -1),
                          rtol=1e-5, atol=1e-4)


def check_builder(candidate: Kernels, reference: Kernels, budget: int, depth: int, vocab: int,
                  device, dtype: torch.dtype) -> str | None:
    """Why `candidate`'s tree builder cannot be trusted here (None if it can): on random and on
    all-tied logits it must build the trees `reference`'s builder builds."""
    gen = torch.Generator(device=device).manual_seed(0)
    cases = [torch.randn((2, depth, vocab), generator=gen, device=device).mul(3).to(dtype),
             torch.zeros((1, depth, vocab), device=device, dtype=dtype)]  # all tied

    def agrees() -> bool:
        for logits in cases:
            ref, out = reference.build_tree(logits, budget), candidate.build_tree(logits, budget)
            if not all(torch.equal(getattr(ref, f), getattr(out, f))
                       for f in ("tokens", "parents", "depths")):
                return False
        return True

    return _check(agrees)


def random_verified_trees(bs: int, n: int, depth: int, vocab: int, gen: torch.Generator,
                          device) -> tuple[torch.Tensor, ...]:
    """(tokens, parents, depths, choice) of bs random verify blocks of n nodes (root at 0,
    siblings with distinct tokens, depth <= `depth`) and target choices that follow the tree
    often: the startup check's material for the acceptance walk (tests use it too)."""
    parents = torch.full((bs, n), -1, dtype=torch.long)
    depths = torch.zeros((bs, n), dtype=torch.long)
    tokens = torch.zeros((bs, n), dtype=torch.long)
    for r in range(bs):
        used: dict[int, set] = {}
        for i in range(1, n):
            open_ = [p for p in range(i) if depths[r, p] < depth and
                     len(used.get(p, ())) < vocab]  # room for a child with a new token
            p = open_[int(torch.randint(0, len(open_), (1,), generator=gen))]
            t = int(torch.randint(0, vocab, (1,), generator=gen))
            while t in used.setdefault(p, set()):
                t = (t + 1) % vocab
            used[p].add(t)
            parents[r, i], depths[r, i], tokens[r, i] = p, depths[r, p] + 1, t
    choice = torch.randint(0, vocab, (bs, n), generator=gen)
    for r in range(bs):  # make the target follow a child at about half the nodes
        for i in range(n):
            kids = (parents[r] == i).nonzero().flatten()
            if len(kids) and torch.rand(1, generator=gen) < 0.6:
                choice[r, i] = tokens[r, kids[int(torch.randint(0, len(kids), (1,),
                                                                generator=gen))]]
    return tuple(x.to(device) for x in (tokens, parents, depths, choice))


def check_accept_kernel(device, depth: int = 15, out_width: int = 16) -> str | None:
    """Why the fused Triton acceptance walk cannot replace accept_stage here (None if it can):
    both must give the same five outputs on random trees."""
    def agrees() -> bool:
        from ddtree_sglang.kernels.accept import accept_stage_triton

        gen = torch.Generator().manual_seed(0)
        for bs, n in ((3, 33), (2, 16), (1, 70)):
            case = random_verified_trees(bs, n, depth, 5, gen, device)
            ref = accept_stage(*case, depth, out_width)
            out = accept_stage_triton(*case, depth, out_width)
            if not all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(ref, out)):
                return False
        return True

    return _check(agrees)


def check_kv_move_kernel(device, width: int = 16) -> str | None:
    """Why the Triton KV move cannot be used here (None if it can): it must move scratch rows
    as move_rows_reference does, including a path that reads rows its own moves write."""
    def agrees() -> bool:
        from ddtree_sglang.kernels.kv_move import move_rows_reference, move_rows_triton

        gen = torch.Generator(device=device).manual_seed(0)
        buffers = [torch.randint(0, 255, (4 * width, n), generator=gen, device=device,
                                 dtype=torch.uint8) for n in (256, 64)]
        base = torch.arange(2, device=device).view(2, 1) * 2 * width
        tgt = base + torch.arange(width, device=device)
        src = base + torch.stack([torch.randperm(2 * width, generator=gen, device=device)[:width]
                                  for _ in range(2)])
        expected = [b.clone() for b in buffers]
        move_rows_reference(expected, tgt, src)
        ptrs = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.uint64, device=device)
        rows = torch.tensor([b.shape[1] for b in buffers], device=device)
        move_rows_triton(ptrs, rows, 256, tgt, src)
        return all(torch.equal(a, b) for a, b in zip(buffers, expected))

    return _check(agrees)
