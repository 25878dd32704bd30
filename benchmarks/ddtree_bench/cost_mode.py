"""Cost mode: the per-step cost of each arm at real model size, without real weights.

A target with Qwen3-8B's configuration and a drafter shaped like z-lab/Qwen3-8B-DFlash-b16 are
written with random weights on the GPU machine (nothing is downloaded).  Acceptance is
meaningless with random weights, cost is not: each arm's decode step time is measured in the
real server, and combined with published acceptance lengths into a *projected* speedup.  The
break-even acceptance length (step time / plain step time) needs no assumption at all.
"""

from __future__ import annotations

import json
from pathlib import Path

# Qwen3-8B (config.json of Qwen/Qwen3-8B) and the z-lab 8B drafter shape (reference notes 2.3).
QWEN3_8B = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936,
                hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1_000_000.0,
                hidden_act="silu", tie_word_embeddings=False, torch_dtype="bfloat16",
                bos_token_id=151643, eos_token_id=151645, attention_bias=False)
DRAFTER_8B = dict(architectures=["DFlashDraftModel"], model_type="qwen3", vocab_size=151936,
                  hidden_size=4096, intermediate_size=12288, num_hidden_layers=5,
                  num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                  max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1_000_000.0,
                  hidden_act="silu", tie_word_embeddings=False, torch_dtype="bfloat16",
                  attention_bias=False, layer_types=["full_attention"] * 5, block_size=16,
                  num_target_layers=36,
                  dflash_config=dict(target_layer_ids=[1, 9, 17, 25, 33], mask_token_id=151669))
# Published mean acceptance lengths, Qwen3-8B, T = 0 (DDTree paper Table 1, mean of 10 sets;
# DDTree at its best budget per data set).
PUBLISHED_TAU = {"DFLASH": 6.00, "DDTREE": 8.71}


def _layer_shapes(cfg: dict, prefix: str) -> dict[str, tuple[int, ...]]:
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    shapes = {}
    for n in range(cfg["num_hidden_layers"]):
        p = f"{prefix}layers.{n}."
        shapes.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
            p + "self_attn.q_norm.weight": (cfg["head_dim"],),
            p + "self_attn.k_norm.weight": (cfg["head_dim"],),
            p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i)})
    return shapes


def write_random_models(workdir: str | Path, device: str = "cuda", target_cfg: dict = QWEN3_8B,
                        drafter_cfg: dict = DRAFTER_8B) -> tuple[Path, Path]:
    """Write (once) the random-weight target and drafter; returns their directories."""
    import torch
    from safetensors.torch import save_file

    root = Path(workdir)
    target, drafter = root / "qwen3_8b_random", root / "qwen3_8b_dflash_random"
    h, v = target_cfg["hidden_size"], target_cfg["vocab_size"]
    taps = len(drafter_cfg["dflash_config"]["target_layer_ids"])
    for path, cfg, shapes in [
        (target, target_cfg, {**_layer_shapes(target_cfg, "model."),
                              "model.embed_tokens.weight": (v, h), "model.norm.weight": (h,),
                              "lm_head.weight": (v, h)}),
        (drafter, drafter_cfg, {**_layer_shapes(drafter_cfg, ""), "fc.weight": (h, taps * h),
                                "hidden_norm.weight": (h,), "norm.weight": (h,)}),
    ]:
        if (path / "model.safetensors").exists():
            continue
        path.mkdir(parents=True, exist_ok=True)
        gen = torch.Generator(device=device).manual_seed(0)
        tensors = {}
        for name, shape in shapes.items():
            if len(shape) == 1:
                tensors[name] = torch.ones(shape, dtype=torch.bfloat16, device=device)
            else:
                tensors[name] = (torch.randn(shape, generator=gen, device=device) * 0.02).to(torch.bfloat16)
        save_file({k: v.cpu() for k, v in tensors.items()}, str(path / "model.safetensors"))
        (path / "config.json").write_text(json.dumps(cfg, indent=2))
        del tensors
    return target, drafter


def step_time_ms(results) -> float | None:
    """Median decode time per target step over requests: (latency - ttft) / steps."""
    vals = []
    for r in results:
        if r.error or len(r.output_ids) < 2:
            continue
        steps = r.verify_ct if r.verify_ct else len(r.output_ids) - 1
        vals.append(1000 * (r.latency - r.ttft) / max(1, steps))
    vals.sort()
    return round(vals[len(vals) // 2], 3) if vals else None


def repeated_step_ms(runs: list) -> dict:
    """A cell measured once or more: its median step time, and with repeats every run's time
    and their spread ((max - min) / median), so a reader sees how far one cell can move."""
    times = [step_time_ms(res) for res in runs]
    known = sorted(t for t in times if t is not None)
    if not known:
        return dict(step_ms=None)
    median = known[len(known) // 2]
    if len(runs) == 1:
        return dict(step_ms=median)
    return dict(step_ms=median, runs_ms=times, spread=round((known[-1] - known[0]) / median, 3))


def fastest_chain(rows: list[dict]) -> dict[int, dict]:
    """Batch size -> the DFLASH row with the shortest step there (DFLASH measured on several
    attention backends: DDTREE is judged against its best)."""
    best: dict[int, dict] = {}
    for r in rows:
        if r["algorithm"] == "DFLASH" and r.get("step_ms"):
            bs = r["batch_size"]
            if bs not in best or r["step_ms"] < best[bs]["step_ms"]:
                best[bs] = r
    return best


def needed_gain(rows: list[dict]) -> dict[tuple[str, int], float]:
    """(DDTREE arm, batch) -> DDTREE step / the fastest DFLASH step: the factor by which the
    tree's accept length must exceed the chain's for DDTREE to be faster (the paper's mean
    gain: 8.71/6.00)."""
    chain = {bs: r["step_ms"] for bs, r in fastest_chain(rows).items()}
    return {(r["arm"], r["batch_size"]): round(r["step_ms"] / chain[r["batch_size"]], 2)
            for r in rows if r["algorithm"] == "DDTREE" and r["step_ms"] and chain.get(r["batch_size"])}


def markdown(results: dict) -> str:
    """Pivot tables (batch x arm): step time, break-even tau, needed gain, projection."""
    m, rows = results["meta"], results["cost_rows"]
    arms = list(dict.fromkeys(r["arm"] for r in rows))
    batches = sorted({r["batch_size"] for r in rows})
    cell = {(r["arm"], r["batch_size"]): r for r in rows}
    gain = needed_gain(rows)
    tree_arms = [a for a in arms if a.startswith("ddtree")]

    def table(title: str, cols: list[str], value) -> list[str]:
        out = [title, "", "| batch | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
        for b in batches:
            vals = [value(a, b) for a in cols]
            out.append(f"| {b} | " + " | ".join("" if v is None else str(v) for v in vals) + " |")
        return out + [""]

    def get(key):
        return lambda a, b: cell.get((a, b), {}).get(key)

    runs = [m["command"]] + [x["command"] for x in m.get("merged_from", [])]
    lines = [f"# Cost mode: Qwen3-8B shapes, random weights, {m['device']}, {m['date']}", "",
             "Commands (one device call each): " + "; ".join(f"`{c}`" for c in runs) + "  ",
             f"Commit: `{m.get('commit', '?')}`. Step time = (request latency - TTFT) / decode "
             "steps, median over the batch's requests, measured in the real server (bf16, triton "
             "attention, CUDA graphs, prompt 512 tokens, 128 new tokens). Acceptance is NOT "
             "measured here (random weights accept ~nothing).", ""]
    lines += table("## Decode step time (ms)", arms, get("step_ms"))
    if any("spread" in r for r in rows):
        lines += table("## Spread of the repeated step-time measurements ((max - min) / median)",
                       arms, get("spread"))
    lines += table("## Break-even accept length (arm step / no-spec step): below it the arm is "
                   "slower than no speculation", arms[1:], get("break_even_tau"))
    lines += table("## Accept-length gain over the DFLASH chain that DDTREE needs to be faster "
                   "(DDTREE step / DFLASH step); the paper's mean gain is 8.71 / 6.00 = 1.45x at "
                   "its best budget (256-512), less at small budgets", tree_arms,
                   lambda a, b: gain.get((a, b)))
    lines += table("## PROJECTED speedup over no speculation (not measured): published accept "
                   f"length x no-spec step / arm step, with DFLASH {PUBLISHED_TAU['DFLASH']} and "
                   f"DDTREE {PUBLISHED_TAU['DDTREE']} for every budget (the paper's best-budget "
                   "mean, Qwen3-8B, T = 0; an upper bound for budgets below 256)", arms[1:],
                   get("projected_speedup"))
    if results.get("failures"):
        lines += ["Arms that failed:", ""] + [f"- {k}: {v}" for k, v in results["failures"].items()]
    return "\n".join(lines) + "\n"


def projection(rows: list[dict]) -> list[dict]:
    """Add break-even tau and projected speedup (published tau) against the plain arm."""
    plain = {r["batch_size"]: r["step_ms"] for r in rows if r["algorithm"] is None}
    out = []
    for r in rows:
        base = plain.get(r["batch_size"])
        row = dict(r)
        if r["algorithm"] and base and r["step_ms"]:
            row["break_even_tau"] = round(r["step_ms"] / base, 2)
            tau = PUBLISHED_TAU[r["algorithm"]]
            row["published_tau"] = tau
            row["projected_speedup"] = round(tau * base / r["step_ms"], 2)
        out.append(row)
    return out
