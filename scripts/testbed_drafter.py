"""DFlash drafter training for the testbed: batches of anchored blocks, the position-decayed
DFlash objective (optionally mixed with distillation), held-out accuracy by block position, and
keeping the best checkpoint.  Shared by train_testbed.py and drafter_accuracy.py; everything
about the drafter (taps, block size, mask token) is read from its own config."""

from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F


def mixed_precision(device_type: str):
    """bfloat16 autocast on a GPU (how the testbed was trained); none on the CPU, where bfloat16
    matrix products are emulated and a smoke run's single step took half a minute."""
    return torch.autocast(device_type, dtype=torch.bfloat16, enabled=device_type == "cuda")


def log(*a) -> None:
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


def lr_at(step: float, total: float, peak: float, warm: float = 0.03) -> float:
    if step < warm * total:
        return peak * step / (warm * total)
    p = min(1.0, (step - warm * total) / max(1e-9, (1 - warm) * total))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))


def optimizer_step(opt, loss, module) -> None:
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
    opt.step()


def tapped_features(model, x: torch.Tensor, taps) -> tuple[torch.Tensor, torch.Tensor]:
    """The drafter's context features (tapped layers, concatenated) and the target's logits."""
    out = model(input_ids=x, output_hidden_states=True)
    return torch.cat([out.hidden_states[i + 1] for i in taps], -1), out.logits


def drafter_batch(model, cfg, x: torch.Tensor, blocks: int, gen: torch.Generator,
                  anchor_min: int = 1, soft: bool = False):
    """Features, block embeddings, positions, mask and labels for `blocks` anchors per row
    (anchors at anchor_min..t-17); with `soft`, also the target's logits for each label."""
    b, t = x.shape
    dev, block, mask_id = x.device, cfg.block_size, cfg.mask_token_id
    with torch.no_grad(), mixed_precision(dev.type):
        feats, tlogits = tapped_features(model, x, cfg.target_layer_ids)
    anchors = torch.stack([torch.randperm(t - block - anchor_min, generator=gen)[:blocks] + anchor_min
                           for _ in range(b)]).to(dev)  # [b, nb], a >= 1 so context is non-empty
    offs = torch.arange(block, device=dev)
    pos = anchors[..., None] + offs  # [b, nb, block]
    block_ids = torch.full((b, blocks, block), mask_id, device=dev)
    block_ids[..., 0] = x.gather(1, anchors)
    labels = x.gather(1, pos.view(b, -1)).view(b, blocks, block)[..., 1:]
    emb = model.get_input_embeddings()(block_ids.view(b, -1)).detach()
    positions = torch.cat([torch.arange(t, device=dev).expand(b, t), pos.view(b, -1)], 1)
    q_block = torch.arange(blocks, device=dev).repeat_interleave(block)  # block of each query
    ctx_ok = torch.arange(t, device=dev)[None, None, :] < anchors.repeat_interleave(block, 1)[..., None]
    own = q_block[:, None] == q_block[None, :]
    mask = torch.cat([ctx_ok, own.expand(b, -1, -1)], dim=2)
    soft_logits = None
    if soft:  # the target's logits at a..a+14 predict the labels at a+1..a+15
        idx = pos[..., :-1].reshape(b, -1, 1).expand(-1, -1, tlogits.shape[-1])
        soft_logits = tlogits.gather(1, idx).view(b, blocks, block - 1, -1)
    return feats, emb, positions, mask, labels, soft_logits


@torch.no_grad()
def drafter_accuracy(model, drafter, seqs: torch.Tensor, dev) -> list[float]:
    """Top-1 accuracy per block position (1..15) on `seqs` (e.g. held-out continuations): the
    gap to the training accuracy shows whether the drafter memorises its data."""
    drafter.eval()
    cfg = drafter.config
    gen = torch.Generator().manual_seed(11)
    hits = torch.zeros(cfg.block_size - 1)
    for i in range(0, seqs.shape[0], 32):
        feats, emb, positions, mask, labels, _ = drafter_batch(model, cfg, seqs[i:i + 32].to(dev),
                                                               8, gen)
        with mixed_precision(torch.device(dev).type):
            h = drafter(feats, emb, positions, mask)
            h = h.view(h.shape[0], -1, cfg.block_size, cfg.hidden_size)[:, :, 1:]
            pred = model.get_output_embeddings()(h).argmax(-1)
        hits += (pred == labels).float().sum(dim=(0, 1)).cpu()
    drafter.train()
    return (hits / (seqs.shape[0] * 8)).tolist()


def train_drafter(model, drafter, seqs: torch.Tensor, seconds: float, dev,
                  batch: int = 32, held: torch.Tensor | None = None, lr: float = 2e-3,
                  anchor_min: int = 1, soft_weight: float = 0.0,
                  val: torch.Tensor | None = None) -> None:
    """DFlash objective, position-decayed; with soft_weight > 0 the hard-label cross-entropy is
    mixed with cross-entropy against the target's own distribution (distillation).  With `val`
    (fresh continuations, not the held-out ones) the drafter of the checkpoint with the best
    validation accuracy is kept: long runs start to memorise their continuations."""
    drafter.to(dev).train()
    cfg, dev_type = drafter.config, torch.device(dev).type
    block = cfg.block_size
    best = (-1.0, 0, None)  # (validation score, step, weights)
    opt = torch.optim.AdamW(drafter.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01,
                            fused=dev_type == "cuda")
    head = model.get_output_embeddings()
    gen = torch.Generator().manual_seed(3)
    weights = torch.exp(-torch.arange(block - 1, device=dev) / 6.0)
    t0, step = time.time(), 0
    while (el := time.time() - t0) < seconds:
        for grp in opt.param_groups:
            grp["lr"] = lr_at(el, seconds, lr)
        idx = torch.randint(0, seqs.shape[0], (batch,), generator=gen)
        x = seqs[idx].to(dev)
        feats, emb, positions, mask, labels, soft = drafter_batch(
            model, cfg, x, 16, gen, anchor_min, soft_weight > 0)
        with mixed_precision(dev_type):
            h = drafter(feats, emb, positions, mask)
            b = h.shape[0]
            h = h.view(b, -1, block, cfg.hidden_size)[:, :, 1:]
            logits = head(h).float()
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                             reduction="none")
        if soft is not None:
            soft_ce = -(soft.float().softmax(-1) * logits.log_softmax(-1)).sum(-1).view(-1)
            ce = (1 - soft_weight) * ce + soft_weight * soft_ce
        loss = (ce.view(b, -1, block - 1) * weights).sum(-1).mean() / weights.sum()
        optimizer_step(opt, loss, drafter)
        step += 1
        if step % 200 == 0:
            acc = (logits.argmax(-1) == labels).float().mean(dim=(0, 1))
            log(f"drafter step {step} loss {loss.item():.3f} top1@1 {acc[0]:.2f} "
                f"@4 {acc[3]:.2f} @8 {acc[7]:.2f} ({el:.0f}s)")
        if held is not None and step % 1000 == 0:
            h = drafter_accuracy(model, drafter, held, dev)
            log(f"drafter held-out top1@1 {h[0]:.2f} @4 {h[3]:.2f} @8 {h[7]:.2f}")
        if val is not None and step % 1000 == 0:
            best = keep_if_best(best, model, drafter, val, dev, step)
    log(f"drafter: {step} steps of {batch} sequences x 16 blocks")
    if val is not None:
        best = keep_if_best(best, model, drafter, val, dev, step)
        drafter.load_state_dict(best[2])
        log(f"drafter: kept step {best[1]} (validation chain proxy {best[0]:.2f})")
    drafter.eval()


def chain_proxy(acc: list[float]) -> float:
    """1 + sum_k prod_{j<=k} acc_j: the chain's accept length if positions failed
    independently - a selection score, not a tau measurement."""
    total, run = 1.0, 1.0
    for a in acc:
        run *= a
        total += run
    return total


def keep_if_best(best: tuple, model, drafter, val: torch.Tensor, dev, step: int):
    score = chain_proxy(drafter_accuracy(model, drafter, val, dev))
    log(f"drafter validation chain proxy {score:.2f} at step {step}")
    if score <= best[0]:
        return best
    return score, step, {k: v.detach().clone() for k, v in drafter.state_dict().items()}
