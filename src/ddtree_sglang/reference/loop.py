"""The reference generation loop: autoregressive, DFlash chain and DDTree(B), in plain PyTorch.

This is the oracle the SGLang worker is checked against and the engine of the CPU demo.  It
favours obviousness over speed: the target recomputes the whole sequence every step (no KV
cache), so every verify pass is a fresh, exact forward with a tree attention mask, and the
drafter sees the tapped target features of every committed token.  One request at a time.

A step of the speculative modes (names follow the paper):
  1. draft:  block [bonus, MASK x (bs-1)] -> drafter -> target lm_head -> logits for depths 1..L
  2. tree:   the B best prefixes (DDTree) or the argmax chain (DFlash)
  3. verify: one target pass over [committed prefix || root + tree] with the ancestor mask
  4. accept: walk the tree along the target's choices; commit the path and the bonus token
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal

import torch

from ddtree_sglang.tree.acceptance import accept_tree, committed_tokens
from ddtree_sglang.budget.controller import BudgetController, expected_by_depth_per_request
from ddtree_sglang.dflash.config import untappable_layers
from ddtree_sglang.tree.verify_layout import build_verify_layout
from ddtree_sglang.sampling.penalties import (PenaltyParams, RequestPenalties, apply_tree_penalties,
                                     path_tokens)
from ddtree_sglang.reference.drafter import DFlashDrafter
from ddtree_sglang.sampling.sample import SamplingParams, target_choice
from ddtree_sglang.tree.builder import build_draft_tree, chain_tree, truncate_tree
from ddtree_sglang.grammar.forcing import force_draft_logits, forced_child_tree, forced_rows
from ddtree_sglang.reference.constrained import ConstrainedRequest

Mode = Literal["ar", "chain", "ddtree"]


@dataclass
class GenerationResult:
    tokens: list[int]
    accept_lens: list[int] = field(default_factory=list)  # per verify step, bonus included
    budgets: list[int] = field(default_factory=list)  # tree nodes verified per DDTree step
    target_forwards: int = 0  # decode-time target passes (prefill excluded)
    seconds: float = 0.0

    @property
    def tau(self) -> float:
        """Mean tokens committed per target pass (the paper's acceptance length)."""
        return sum(self.accept_lens) / len(self.accept_lens) if self.accept_lens else 1.0


class ReferenceSpeculator:
    """A transformers causal-LM target plus a DFlash drafter that borrows its embedding/head."""

    def __init__(self, target: torch.nn.Module, drafter: DFlashDrafter,
                 eos_token_ids: tuple[int, ...] = ()) -> None:
        self.target = target
        self.drafter = drafter
        self.cfg = drafter.config
        self.eos = set(eos_token_ids)
        self.embed = target.get_input_embeddings()
        self.lm_head = target.get_output_embeddings()
        n_layers = target.config.num_hidden_layers
        bad = untappable_layers(self.cfg.target_layer_ids, n_layers)
        if bad:
            raise ValueError(f"drafter taps target layers {bad} of a {n_layers}-layer target; "
                             f"accepted: 0..{n_layers - 2} (the last layer cannot be tapped)")

    @property
    def max_positions(self) -> int:
        return int(getattr(self.target.config, "max_position_embeddings", 1 << 30))

    def max_new_tokens_for(self, prompt_len: int) -> int:
        """Most new tokens a prompt can get: every position a step touches stays inside the
        target's position range."""
        return max(0, self.max_positions - prompt_len - self.cfg.block_size)

    @property
    def device(self) -> torch.device:
        return next(self.target.parameters()).device

    # -- target ------------------------------------------------------------------------------
    def _target(self, ids: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor):
        """One target pass; allowed [T, T] bool (True = attend).  Returns logits [T, V] and the
        tapped features [T, taps*H] (output of decoder layer l for l in target_layer_ids)."""
        dtype = next(self.target.parameters()).dtype
        mask = torch.zeros(allowed.shape, dtype=dtype, device=ids.device)
        mask.masked_fill_(~allowed, torch.finfo(dtype).min)
        out = self.target(input_ids=ids[None], position_ids=positions[None],
                          attention_mask=mask[None, None], output_hidden_states=True)
        feats = torch.cat([out.hidden_states[i + 1][0] for i in self.cfg.target_layer_ids], -1)
        return out.logits[0].float(), feats

    def _causal(self, ids: torch.Tensor):
        t = ids.shape[0]
        allowed = torch.ones((t, t), dtype=torch.bool, device=ids.device).tril()
        return self._target(ids, torch.arange(t, device=ids.device), allowed)

    # -- drafter -----------------------------------------------------------------------------
    def draft_logits(self, feats: torch.Tensor, bonus: int) -> torch.Tensor:
        """[1, L, V] drafter logits for the L = block_size - 1 tokens after `bonus`."""
        start = feats.shape[0]
        block = torch.full((self.cfg.block_size,), self.cfg.mask_token_id, device=feats.device)
        block[0] = bonus
        emb = self.embed(block)[None]
        positions = torch.arange(start + self.cfg.block_size, device=feats.device)[None]
        hidden = self.drafter(feats[None].to(emb.dtype), emb, positions)
        return self.lm_head(hidden[:, 1:]).float()

    # -- generation --------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompt: list[int], max_new_tokens: int, mode: Mode = "ddtree",
                 budget: int | BudgetController = 32,
                 sampling: SamplingParams = SamplingParams(),
                 seed: int = 0, penalties: RequestPenalties = RequestPenalties(),
                 grammar: ConstrainedRequest | None = None) -> GenerationResult:
        """`seed` seeds this call's generator; `sampling.seed` (if set) instead makes every
        draw a function of (seed, position), identical across modes and budgets.  `budget` is
        a fixed B or a BudgetController that picks B per step (and learns from acceptance;
        B = 0 is a step without speculation: the root alone, one token).
        `grammar`: a constrained request (every choice under its mask; it ends when the
        grammar does)."""
        if mode not in ("ar", "chain", "ddtree"):
            raise ValueError(f"mode must be one of ar, chain, ddtree; got {mode!r}")
        if not prompt:
            raise ValueError("prompt must hold at least one token")
        room = self.max_new_tokens_for(len(prompt))
        if max_new_tokens > room:
            raise ValueError(f"a {len(prompt)}-token prompt leaves room for {room} new tokens in "
                             f"the target's {self.max_positions} positions (a step reads "
                             f"{self.cfg.block_size} past the output); got max_new_tokens "
                             f"{max_new_tokens}")
        gen = torch.Generator(device=self.device).manual_seed(seed)
        state = _History(penalties, self.lm_head.weight.shape[0], self.device)
        t0 = time.perf_counter()
        ids = torch.tensor(prompt, device=self.device)
        logits, feats = self._causal(ids)
        out = [self._choose(logits[-1:], ids.new_tensor([len(prompt) - 1]), state, sampling,
                            gen, grammar)]
        if grammar is not None:
            grammar.commit(out)
        state.extend(out)
        result = GenerationResult(tokens=out)
        while len(out) < max_new_tokens and out[-1] not in self.eos and not (
                grammar is not None and grammar.done):
            if mode == "ar":
                ids = torch.cat([ids, ids.new_tensor(out[-1:])])
                logits, _ = self._causal(ids)
                new = [self._choose(logits[-1:], ids.new_tensor([len(ids) - 1]), state,
                                    sampling, gen, grammar)]
            else:
                ids, feats, new, nodes = self._spec_step(ids, feats, out[-1], mode, budget,
                                                         sampling, gen, state, grammar)
                if mode == "ddtree":
                    result.budgets.append(nodes)
            if grammar is not None:
                new = new[:grammar.commit(new)]
            out.extend(new)
            state.extend(new)
            result.accept_lens.append(len(new))
            result.target_forwards += 1
        result.tokens = _truncate(out, max_new_tokens, self.eos)
        result.seconds = time.perf_counter() - t0
        return result

    def _choose(self, logits: torch.Tensor, positions: torch.Tensor, state: "_History",
                sampling: SamplingParams, gen: torch.Generator,
                grammar: ConstrainedRequest | None = None) -> int:
        """The target's token after one position (AR and the prefill): a one-node tree."""
        zeros = positions.new_zeros((1, 1))
        logits = state.penalise(logits[None], torch.full((1, 1, 0), -1), zeros)
        if grammar is not None:
            logits = logits.masked_fill(~grammar.allowed_next(logits.device)[None], float("-inf"))
        return int(target_choice(logits, [sampling], gen, positions.view(1, 1))[0, 0])

    def _spec_step(self, ids: torch.Tensor, feats: torch.Tensor, bonus: int, mode: Mode,
                   budget: int | BudgetController, sampling: SamplingParams,
                   gen: torch.Generator, state: "_History",
                   grammar: ConstrainedRequest | None = None):
        """ids: committed tokens before the bonus (features known for all of them).  Returns
        the new ids and features, the emitted tokens and the number of tree nodes verified."""
        start = ids.shape[0]
        dl = self.draft_logits(feats, bonus)
        spine = grammar.spine(self.cfg.draft_depth) if grammar is not None else []
        if spine:
            dl = force_draft_logits(dl, forced_rows([spine], self.cfg.draft_depth).to(dl.device))
        depth_probs = None
        if mode == "chain":
            tree = chain_tree(dl)
        elif not isinstance(budget, int):  # a BudgetController (or its stand-in)
            tree, depth_probs = self._chosen_tree(dl, budget)
        elif grammar is not None and grammar.force_children:
            tree = forced_child_tree(torch.log_softmax(dl[0].float(), -1).cpu(), budget,
                                     grammar.forced_after)
        else:
            tree = build_draft_tree(dl, budget)
        root = ids.new_tensor([bonus])
        layout = build_verify_layout(tree, root, ids.new_tensor([start]))
        n = layout.num_tokens_per_req
        seq = torch.cat([ids, layout.draft_tokens])
        positions = torch.cat([torch.arange(start, device=ids.device), layout.positions])
        allowed = torch.ones((start + n, start + n), dtype=torch.bool, device=ids.device).tril()
        allowed[start:, start:] = layout.ancestors[0]
        logits, all_feats = self._target(seq, positions, allowed)
        tokens2d = layout.draft_tokens.view(1, n)
        paths = path_tokens(tokens2d, layout.tree_parents, layout.tree_depths,
                            self.cfg.draft_depth)
        node_logits = state.penalise(logits[None, start:], paths, layout.tree_depths)
        if grammar is not None:
            allowed = grammar.node_masks(layout.retrieve_next_token[0],
                                         layout.retrieve_next_sibling[0], layout.draft_tokens)
            node_logits = node_logits.masked_fill(~allowed[None], float("-inf"))
        choice = target_choice(node_logits, [sampling], gen, layout.positions.view(1, n))
        acc = accept_tree(tokens2d, layout.tree_parents, layout.tree_depths, choice,
                          max_depth=self.cfg.draft_depth)
        k = int(acc.accept_len[0])
        if grammar is not None:
            grammar.stats.record(spine, k - 1)
        if depth_probs is not None:
            budget.observe(1, tree.budget, depth_probs, acc.accept_len - 1)
        emitted = committed_tokens(tokens2d, acc)[0, :k].tolist()
        path = acc.accept_path[0, :k]
        new_ids = torch.cat([ids, tokens2d[0, path]])  # root (old bonus) + accepted nodes
        new_feats = torch.cat([all_feats[:start], all_feats[start + path]])
        return new_ids, new_feats, emitted, tree.budget


    def _chosen_tree(self, draft_logits: torch.Tensor, controller: BudgetController):
        """The largest candidate's tree cut to the controller's choice for it, and the
        candidates' expected acceptance by depth (what the controller learns from)."""
        tree = build_draft_tree(draft_logits, controller.budgets[-1])
        depth_probs = expected_by_depth_per_request(tree.scores, tree.depths,
                                                    controller.budgets, self.cfg.draft_depth)
        chosen = controller.choose(1, controller.calibrated(depth_probs).tolist())
        return truncate_tree(tree, chosen), depth_probs


class _History:
    """The request's output so far, as the penalties need it (token counts and length)."""

    def __init__(self, penalties: RequestPenalties, vocab: int, device) -> None:
        self.active = penalties.active
        self.params = PenaltyParams.of([penalties], device)
        self.counts = torch.zeros((1, vocab), dtype=torch.int32, device=device)
        self.out_len = torch.zeros(1, dtype=torch.int64, device=device)

    def extend(self, tokens: list[int]) -> None:
        for t in tokens:
            self.counts[0, t] += 1
        self.out_len += len(tokens)

    def penalise(self, logits: torch.Tensor, paths: torch.Tensor,
                 depths: torch.Tensor) -> torch.Tensor:
        if not self.active:
            return logits
        return apply_tree_penalties(logits.float().clone(), self.counts, self.out_len,
                                    self.params, paths.to(logits.device), depths)


def _truncate(tokens: list[int], limit: int, eos: set[int]) -> list[int]:
    for i, t in enumerate(tokens[:limit]):
        if t in eos:
            return tokens[: i + 1]
    return tokens[:limit]
