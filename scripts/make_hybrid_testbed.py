"""Write a tiny hybrid (gated-delta + attention) target and its DFlash drafter, from the shipped
testbed pair, with no download and no GPU:

    python scripts/make_hybrid_testbed.py --source testbed --out testbed_hybrid --eval

testbed_hybrid/ ships without the target's weights, its tokenizer.json and the links (11 MB,
kept out of git so that the working tree travels to a GPU machine): `--restore` writes them from
the settings its made_with.json records, then checks every written file against the sha256
recorded there (tests/gpu/e2e_server.py runs it before serving a generated testbed; the tests
build one per session the same way).

The target (--arch qwen3_next, the default) is a Qwen3-Next model (Qwen3NextForCausalLM: served
by SGLang 0.5.17's qwen3_next.py, which captures the drafter's features, loaded by transformers
5.x) of 2L layers, gated-delta and full attention alternating (full_attention_interval 2).  Its
full-attention layers are the source Qwen3 target's L trained layers, carried over exactly:
Qwen3-Next norms scale by 1 + w (w - 1 is stored), its attention has a sigmoid output gate
(gate rows zero: a gate of 1/2, the output projection doubled), partial_rotary_factor is 1, and
its MLP is a mixture of one expert (the source MLP, routed with weight 1) and a shared expert
switched off (zero output).  The gated-delta layers are random, their output scaled by
--linear-scale, their MLP zero: at 0 the target is the source target (checked here), above 0 its
tokens depend on the recurrent state a tree verify must commit.  --arch qwen3_5 writes the same
as a dense Qwen3.5 text model (Qwen3_5ForCausalLM), which transformers runs but SGLang 0.5.17
cannot serve as a DFLASH / DDTREE target (its text-only wrapper has no
set_dflash_layers_to_capture).

The drafter is the source drafter, its taps moved to the same layers' new indices (its weights a
link to the source's), so it drafts what it learned for the source target; --linear-scale trades
how much the recurrent layers matter against how much of its acceptance survives.

Acceptance (--eval, greedy, tau = tokens committed per target pass, bonus included): the
target's greedy continuation of each prompt is computed once (full causal passes); at each step
the drafter's chain or B-best tree is walked along that continuation from the committed prefix,
which is what a greedy verify accepts, the prefix's target features taken from one causal pass.
No tree-masked target pass is needed, which a recurrent layer cannot take in transformers.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

import torch

from ddtree_sglang.cli import CliError, Parser, non_negative_float, positive_int, \
    positive_int_list, run

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "generation_config.json")
ARCHS = ("qwen3_next", "qwen3_5")
LINKS = ("drafter/model.safetensors", "prompts.jsonl")  # the source pair's files, same paths
SHARED_EXPERT = 16  # the switched-off shared expert's width (Qwen3-Next has one per layer)
# what made_with.json records and --restore builds from
SETTINGS = ("arch", "linear_scale", "seed", "linear_heads", "linear_dims")


def hybrid_config(src, arch: str, linear_heads: tuple[int, int], linear_dims: tuple[int, int]):
    """The config of 2L layers around the source Qwen3 config's L."""
    layers = 2 * src.num_hidden_layers
    rope = dict(src.rope_parameters or {"rope_type": "default", "rope_theta": 10000.0})
    rope["partial_rotary_factor"] = 1.0
    common = dict(
        vocab_size=src.vocab_size, hidden_size=src.hidden_size,
        intermediate_size=src.intermediate_size, num_hidden_layers=layers,
        num_attention_heads=src.num_attention_heads,
        num_key_value_heads=src.num_key_value_heads, head_dim=src.head_dim,
        hidden_act=src.hidden_act, max_position_embeddings=src.max_position_embeddings,
        rms_norm_eps=src.rms_norm_eps, rope_parameters=rope, partial_rotary_factor=1.0,
        attention_bias=False, linear_conv_kernel_dim=4, linear_num_key_heads=linear_heads[0],
        linear_num_value_heads=linear_heads[1], linear_key_head_dim=linear_dims[0],
        linear_value_head_dim=linear_dims[1],
        layer_types=["linear_attention" if i % 2 == 0 else "full_attention"
                     for i in range(layers)],
        full_attention_interval=2,  # SGLang's Qwen3NextConfig places layers by it
        bos_token_id=src.bos_token_id, eos_token_id=src.eos_token_id,
        pad_token_id=src.pad_token_id)
    if arch == "qwen3_next":
        from transformers import Qwen3NextConfig

        # SGLang's Qwen3-Next loads an lm_head of its own: never tied
        return Qwen3NextConfig(**common, tie_word_embeddings=False, num_experts=1,
                               num_experts_per_tok=1, norm_topk_prob=True,
                               moe_intermediate_size=src.intermediate_size,
                               shared_expert_intermediate_size=SHARED_EXPERT,
                               decoder_sparse_step=1, mlp_only_layers=[])
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(**common, tie_word_embeddings=src.tie_word_embeddings)


@torch.no_grad()
def carry_mlp(mlp, src_mlp) -> None:
    """A layer's MLP := the source MLP (None: zero output); dense, or one routed expert beside
    a switched-off shared expert."""
    if not hasattr(mlp, "experts"):
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(mlp, name).weight.copy_(getattr(src_mlp, name).weight if src_mlp else 0)
        return
    mlp.gate.weight.zero_()  # one expert: its routing weight is 1 whatever the logits
    mlp.shared_expert.down_proj.weight.zero_()
    mlp.shared_expert_gate.weight.zero_()
    if src_mlp is None:
        mlp.experts.down_proj.zero_()
        return
    mlp.experts.gate_up_proj[0].copy_(torch.cat([src_mlp.gate_proj.weight,
                                                 src_mlp.up_proj.weight]))
    mlp.experts.down_proj[0].copy_(src_mlp.down_proj.weight)


@torch.no_grad()
def draw_random(model, seed: int) -> None:
    """The weights transformers draws at random, drawn again from the script's own generator in
    name order (matrices normal(0, initializer_range), A_log the log of uniform(0.01, 16)), so
    that the bytes do not depend on how a transformers version initializes (5.17 draws A_log
    from another range than 5.12); the constant ones (norms, dt_bias) are transformers'."""
    gen = torch.Generator().manual_seed(seed)
    std = model.config.initializer_range
    for name, w in sorted(model.named_parameters()):
        if w.dim() >= 2:
            w.copy_(torch.randn(w.shape, generator=gen) * std)
        elif name.endswith(".A_log"):
            w.copy_(torch.empty(w.shape).uniform_(0.01, 16, generator=gen).log())


@torch.no_grad()
def carry_over(src_model, model) -> None:
    """The source layers into the odd (full attention) layers, exactly; the even (gated-delta)
    layers keep their random token mixer, their MLP zero."""
    s, m = src_model.model, model.model
    m.embed_tokens.weight.copy_(s.embed_tokens.weight)
    m.norm.weight.copy_(s.norm.weight - 1)
    if not model.config.tie_word_embeddings:
        model.lm_head.weight.copy_(src_model.get_output_embeddings().weight)
    hd, heads = model.config.head_dim, model.config.num_attention_heads
    for i, src_layer in enumerate(s.layers):
        full, linear = m.layers[2 * i + 1], m.layers[2 * i]
        for name in ("input_layernorm", "post_attention_layernorm"):
            getattr(full, name).weight.copy_(getattr(src_layer, name).weight - 1)
        sa, fa = src_layer.self_attn, full.self_attn
        q = fa.q_proj.weight.view(heads, 2, hd, -1)  # per head: query rows, then gate rows
        q[:, 0].copy_(sa.q_proj.weight.view(heads, hd, -1))
        q[:, 1].zero_()  # sigmoid(0) = 1/2 on every output ...
        fa.o_proj.weight.copy_(2 * sa.o_proj.weight)  # ... undone here
        for name in ("k_proj", "v_proj"):
            getattr(fa, name).weight.copy_(getattr(sa, name).weight)
        for name in ("q_norm", "k_norm"):
            getattr(fa, name).weight.copy_(getattr(sa, name).weight - 1)
        carry_mlp(full.mlp, src_layer.mlp)
        carry_mlp(linear.mlp, None)


@torch.no_grad()
def max_logit_gap(a, b, ids: torch.Tensor) -> float:
    return float((a(input_ids=ids[None]).logits - b(input_ids=ids[None]).logits).abs().max())


def build(source: Path, arch: str, linear_scale: float, seed: int,
          linear_heads: tuple[int, int], linear_dims: tuple[int, int], check_ids: torch.Tensor):
    """(source target, hybrid target) in float32; the carry-over checked with the gated-delta
    layers' output at zero."""
    from transformers import AutoModelForCausalLM, Qwen3_5ForCausalLM, Qwen3NextForCausalLM

    src = AutoModelForCausalLM.from_pretrained(source / "target", dtype=torch.float32).eval()
    cfg = hybrid_config(src.config, arch, linear_heads, linear_dims)
    model = (Qwen3NextForCausalLM if arch == "qwen3_next" else Qwen3_5ForCausalLM)(cfg).eval()
    draw_random(model, seed)
    carry_over(src, model)
    outs = [layer.linear_attn.out_proj.weight for layer in model.model.layers[::2]]
    drawn = [w.detach().clone() for w in outs]
    with torch.no_grad():
        for w in outs:
            w.zero_()
        gap = max_logit_gap(src, model, check_ids)
        if gap > 1e-3:
            raise RuntimeError(f"the carried-over layers do not reproduce the source target: "
                               f"logits differ by {gap:.3g} with the gated-delta layers off")
        for w, d in zip(outs, drawn):
            w.copy_(d * linear_scale)
    return src, model


def drafter_config(source: Path, hybrid_layers: int) -> dict:
    """The source drafter's config with its taps at the carried-over layers' new indices."""
    cfg = json.loads((source / "drafter" / "config.json").read_text())
    taps = cfg["dflash_config"]["target_layer_ids"]
    cfg["dflash_config"]["target_layer_ids"] = [2 * t + 1 for t in taps]
    cfg["num_target_layers"] = hybrid_layers
    return cfg


def write(out: Path, source: Path, model) -> None:
    """The target's weights (float16), its tokenizer files, the drafter's config; the drafter's
    weights and the prompts are links to the source pair's (the same bytes)."""
    target = out / "target"
    target.mkdir(parents=True, exist_ok=True)
    model.to(torch.float16).save_pretrained(target)
    model.to(torch.float32)
    cfg_file = target / "config.json"  # the top-level keys SGLang's Qwen3NextConfig reads
    raw = json.loads(cfg_file.read_text())
    raw.update(partial_rotary_factor=1.0, full_attention_interval=2,
               rope_theta=raw.get("rope_parameters", {}).get("rope_theta", 10000.0))
    raw.pop("transformers_version", None)  # the same bytes whichever version wrote them
    cfg_file.write_text(json.dumps(raw, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        if (source / "target" / name).is_file():
            shutil.copy(source / "target" / name, target / name)
    drafter = out / "drafter"
    drafter.mkdir(parents=True, exist_ok=True)
    (drafter / "config.json").write_text(json.dumps(
        drafter_config(source, model.config.num_hidden_layers), indent=2) + "\n")
    for name in LINKS:
        link, real = out / name, source / name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(os.path.relpath(real.resolve(), link.parent.resolve()))


def generate(source: Path, out: Path, settings: dict) -> tuple:
    """Build and write the testbed for `settings` (the SETTINGS keys): the one path from the
    settings to the bytes, for a new testbed and a restored one; (source target, hybrid
    target, the ids its logits were checked on)."""
    check = torch.randint(4, 4000, (200,), generator=torch.Generator().manual_seed(0))
    src, model = build(source, settings["arch"], settings["linear_scale"], settings["seed"],
                       tuple(settings["linear_heads"]), tuple(settings["linear_dims"]), check)
    write(out, source, model)
    return src, model, check


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def digests(out: Path) -> dict[str, str]:
    """sha256 of each file the script writes, by its path under `out` (the links are left out:
    they are the source pair's files)."""
    return {p.relative_to(out).as_posix(): sha256(p) for folder in ("target", "drafter")
            for p in sorted((out / folder).iterdir()) if p.is_file() and not p.is_symlink()}


def restore(out: Path, source: Path) -> None:
    """Write `out`'s files and links from the settings its made_with.json records when any is
    missing (made_with.json untouched), then refuse unless every file is the recorded bytes:
    another torch may draw other random layers."""
    record_file = out / "made_with.json"
    if not record_file.is_file():
        raise CliError(f"--restore: no {record_file} (the record to rebuild from)")
    record = json.loads(record_file.read_text())
    recorded = record.get("sha256") or {}
    if not recorded:
        raise CliError(f"--restore: {record_file} records no sha256 (made before --restore)")
    built = not all((out / name).is_file() for name in (*recorded, *LINKS))
    if built:
        generate(source, out, record)
    bad = [name for name, digest in recorded.items()
           if not (out / name).is_file() or sha256(out / name) != digest]
    if bad:
        import transformers

        why = (f"torch {torch.__version__} / transformers {transformers.__version__} write other "
               "bytes" if built else "delete them to rebuild")
        raise CliError(f"--restore: {out}: {', '.join(bad)} not the bytes {record_file} records "
                       f"(sha256): {why}")


# -- acceptance ------------------------------------------------------------------------------
@torch.no_grad()
def greedy(model, prompt: list[int], new: int, eos: set[int]) -> list[int]:
    """The target's greedy continuation, each token from a full causal pass (no cache)."""
    ids = list(prompt)
    for _ in range(new):
        tok = int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
        ids.append(tok)
        if tok in eos:
            break
    return ids[len(prompt):]


@torch.no_grad()
def greedy_tau(model, drafter, prompt: list[int], cont: list[int], budget: int | None) -> list[int]:
    """Tokens committed per verify step of a greedy speculative decode of `cont` (the target's
    greedy continuation): the chain (budget None) or the B-best tree walked along `cont`."""
    from ddtree_sglang.tree.builder import build_draft_tree, chain_tree

    seq = torch.tensor(prompt + cont)
    out = model(input_ids=seq[None], output_hidden_states=True)
    cfg = drafter.config
    feats = torch.cat([out.hidden_states[i + 1][0] for i in cfg.target_layer_ids], -1)
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    lens, c = [], len(prompt)  # committed tokens in the target's cache; seq[c] is the bonus
    while c + 1 < len(seq):
        block = torch.full((cfg.block_size,), cfg.mask_token_id)
        block[0] = seq[c]
        positions = torch.arange(c + cfg.block_size)[None]
        hidden = drafter(feats[None, :c], embed(block)[None], positions)
        logits = head(hidden[:, 1:]).float()
        tree = chain_tree(logits) if budget is None else build_draft_tree(logits, budget)
        node, accepted = -1, 0  # walk from the root along the continuation
        while c + 1 + accepted < len(seq):
            want = int(seq[c + 1 + accepted])
            kids = [j for j in range(tree.budget) if int(tree.parents[0, j]) == node
                    and int(tree.tokens[0, j]) == want]
            if not kids:
                break
            node, accepted = kids[0], accepted + 1
        lens.append(accepted + 1)
        c += accepted + 1
    return lens


@torch.no_grad()
def next_token_agreement(model, src_model, seqs: list[list[int]], starts: list[int]) -> float:
    """How often the two targets choose the same next token after the same prefixes (the
    source target's greedy continuations): below 1, the recurrent layers change tokens."""
    same = total = 0
    for seq, start in zip(seqs, starts):
        ids = torch.tensor([seq])
        a = model(input_ids=ids).logits[0, start - 1:-1].argmax(-1)
        b = src_model(input_ids=ids).logits[0, start - 1:-1].argmax(-1)
        same, total = same + int((a == b).sum()), total + a.numel()
    return round(same / total, 3)


def evaluate(source: Path, model, src_model, drafter_dir: Path, prompts: int, new: int,
             budgets: list[int]) -> dict:
    from transformers import AutoTokenizer

    from ddtree_sglang.reference.drafter import DFlashDrafter
    from ddtree_sglang.reference.testbed import encode_prompt, read_prompts

    tok = AutoTokenizer.from_pretrained(source / "target")
    eos = {t for t in (tok.convert_tokens_to_ids("<|endoftext|>"),
                       tok.convert_tokens_to_ids("<|im_end|>")) if t is not None}
    rows = [encode_prompt(tok, r) for r in read_prompts(source / "prompts.jsonl")[:prompts]]
    pairs = {"hybrid": (model, DFlashDrafter.from_pretrained(drafter_dir)),
             "source": (src_model, DFlashDrafter.from_pretrained(source / "drafter"))}
    report: dict = {}
    conts = {name: [greedy(m, p, new, eos) for p in rows] for name, (m, _) in pairs.items()}
    report["next_token_agreement_with_source"] = next_token_agreement(
        model, src_model, [p + c for p, c in zip(rows, conts["source"])],
        [len(p) for p in rows])
    for name, (m, d) in pairs.items():
        for budget in [None] + budgets:
            lens = [n for p, c in zip(rows, conts[name]) for n in greedy_tau(m, d, p, c, budget)]
            arm = "chain" if budget is None else f"ddtree_B{budget}"
            report[f"{name}_{arm}_tau"] = round(sum(lens) / len(lens), 3)
            report[f"{name}_{arm}_longest"] = max(lens)
            print(name, arm, report[f"{name}_{arm}_tau"], flush=True)
    return report


def main() -> None:
    ap = Parser(prog="make_hybrid_testbed", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", type=Path, default=Path("testbed"))
    ap.add_argument("--out", type=Path, default=Path("testbed_hybrid"))
    ap.add_argument("--arch", choices=ARCHS, default="qwen3_next")
    ap.add_argument("--linear-scale", type=non_negative_float, default=10.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--linear-heads", type=positive_int_list, default=[2, 4],
                    help="gated-delta key heads, value heads")
    ap.add_argument("--linear-dims", type=positive_int_list, default=[32, 32],
                    help="gated-delta key head dim, value head dim")
    ap.add_argument("--eval", action="store_true", help="measure greedy acceptance (CPU)")
    ap.add_argument("--prompts", type=positive_int, default=16)
    ap.add_argument("--max-new-tokens", type=positive_int, default=64)
    ap.add_argument("--budgets", type=positive_int_list, default=[8, 32])
    ap.add_argument("--restore", action="store_true",
                    help="write OUT's files from the settings OUT/made_with.json records if any "
                    "is missing, check them against its sha256 (the other settings are unused)")
    args = ap.parse_args()
    if len(args.linear_heads) != 2 or len(args.linear_dims) != 2:
        raise CliError("--linear-heads and --linear-dims take two numbers each")
    if not (args.source / "target" / "config.json").is_file():
        raise CliError(f"--source {args.source}: no target/config.json (the shipped pair is "
                       "testbed/)")
    if args.restore:
        restore(args.out, args.source)
        print(f"{args.out}: the files made_with.json records (sha256 checked)")
        return
    settings = {name: getattr(args, name) for name in SETTINGS}
    src, model, check = generate(args.source, args.out, settings)
    written = digests(args.out)
    summary = dict(**settings,
                   max_logit_change_vs_source=round(max_logit_gap(src, model, check), 3),
                   bytes=sum((args.out / name).stat().st_size for name in written),
                   sha256=written)
    if args.eval:
        summary |= dict(prompts=args.prompts, max_new_tokens=args.max_new_tokens)
        summary |= evaluate(args.source, model, src, args.out / "drafter", args.prompts,
                            args.max_new_tokens, args.budgets)
    summary["command"] = " ".join(["python scripts/make_hybrid_testbed.py", *sys.argv[1:]])
    (args.out / "made_with.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary))


if __name__ == "__main__":
    sys.exit(run(main, "make_hybrid_testbed"))
