"""Train the testbed pair on the GPU machine: a small Qwen3 target and its DFlash drafter.

Corpus: the Python standard library's own source on that machine (no network needed); files whose
name hashes into the held-out bucket are kept for evaluation only.  Stages, each skipped when its
output already exists in --work (so a second call resumes):

  1. tokenizer  byte-level BPE (4096 tokens) with chat and DFlash mask special tokens
  2. target     Qwen3ForCausalLM (tied embeddings), next-token loss on the corpus and on
                chat-formatted samples of it
  3. data       target continuations (greedy and T=1) of corpus prompts, for the drafter
  4. drafter    DFlash objective: from [x_a, MASK x 15] at positions a..a+15 and the target's
                tapped hidden states of positions < a, predict x_{a+1..a+15}
  5. export     testbed/ layout (target/, drafter/, prompts.jsonl) + fp16 weights

Recipes (one H200 call each):

    # close to v1, the shipped pair (chain tau 1.53 at T = 0; v1 also trained the tokenizer on
    # every text, not a third, and sampled every other continuation batch at T = 1):
    python scripts/train_testbed.py --corpus stdlib --gen-seqs 4096 --real-seqs 4096 \
        --taps 1,2 --target-seconds 160 --drafter-seconds 140
    # v2 (tried, chain tau 1.31): --corpus all --gen-seqs 4096, 150 s + 150 s
    # v3, the shipped pair (chain tau 2.28, DDTree B=32 3.31): 3-layer target, 2-layer drafter,
    # then the drafter continued from that export with greedy-heavy data and some distillation
    python scripts/train_testbed.py --corpus all --gen-seqs 16384 --gen-batch 2048 \
        --drafter-batch 128 --target-layers 3 --draft-layers 2 --taps 0,1 \
        --target-seconds 140 --drafter-seconds 200 --out runs/b
    python scripts/train_testbed.py --init-from runs/b --work /tmp/v3 --corpus all \
        --gen-seqs 20480 --gen-batch 2048 --sampled-every 8 --anchor-min 48 --soft-weight 0.3 \
        --drafter-lr 1e-3 --drafter-batch 128 --drafter-seconds 318
    # (scripts/gpu_train.sh runs several such candidates side by side; testbed/README.md has
    # the exact calls.)  The last target layer cannot be tapped (SGLang captures layer k at
    # layer k + 1's input), so taps stay <= layers - 2.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import shutil
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ddtree_sglang.cli import (Parser, finite_float, index_list, non_negative_float,
                               non_negative_int, positive_float, positive_int, require_cuda, run)
from ddtree_sglang.dflash.config import (DFlashConfig, NotADFlashCheckpoint, load_dflash_config,
                                         untappable_layers)
from ddtree_sglang.reference.drafter import DFlashDrafter
from testbed_drafter import (drafter_accuracy, log, lr_at,  # scripts/ is on sys.path as a script
                             mixed_precision, optimizer_step, train_drafter)

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
VOCAB, HIDDEN, LAYERS, INTER = 4096, 256, 4, 448
DRAFT_LAYERS, DRAFT_INTER, BLOCK, TAPS = 1, 448, 16, (1, 2)
SEQ = 512
DEV_TYPE = "cuda"


# -- corpus -----------------------------------------------------------------------------------
def corpus_files(kind: str = "all", max_bytes: int = 60_000_000) -> tuple[list[Path], list[Path]]:
    """Python sources on the machine, in a fixed order: `stdlib` - the standard library without
    its tests and site-packages (testbed v1, ~2.8 M tokens); `all` - the standard library with
    tests and the installed packages, up to max_bytes (~18 M tokens).  A file whose name hashes
    into bucket 0 of 16 is held out (never trained on) and supplies the evaluation prompts."""
    paths = sysconfig.get_paths()
    if kind == "stdlib":
        roots = [Path(paths["stdlib"])]
        skip = lambda p: bool({"site-packages", "test", "tests"} & set(p.parts))  # noqa: E731
    else:
        roots = [Path(paths["stdlib"]), Path(paths["purelib"]), Path(paths["platlib"])]
        skip = lambda p: False  # noqa: E731
    seen, files, total = set(), [], 0
    for root in roots:
        for p in sorted(root.rglob("*.py")):
            if p in seen or skip(p) or not (500 < p.stat().st_size < 300_000):
                continue
            seen.add(p)
            files.append(p)
    picked = files  # stdlib (v1): every file, sorted
    if kind != "stdlib":
        random.Random(0).shuffle(files)
        picked = []
        for p in files:
            if total > max_bytes:
                break
            picked.append(p)
            total += p.stat().st_size
    held = [p for p in picked if int(hashlib.md5(p.name.encode()).hexdigest(), 16) % 16 == 0]
    held_set = set(held)
    return [p for p in picked if p not in held_set], held


def encode_files(tok, files: list[Path]) -> torch.Tensor:
    """The files' token ids, concatenated (no separators): prompt material for continuations."""
    texts = [p.read_text(errors="ignore") for p in files]
    return torch.tensor([i for ids in tok(texts, add_special_tokens=False)["input_ids"] for i in ids],
                        dtype=torch.long)


def chat_sample(rel: str, text: str, rng: random.Random) -> str:
    lines = text.splitlines()
    cut = rng.randint(3, max(4, min(40, len(lines) // 2)))
    head, rest = "\n".join(lines[:cut]), "\n".join(lines[cut:cut + 80])
    ask = rng.choice([f"Continue this Python code from {rel}:\n{head}",
                      f"Here is the start of {rel}. Write the next part.\n{head}",
                      f"Complete the following code.\n{head}"])
    return (f"<|im_start|>user\n{ask}<|im_end|>\n<|im_start|>assistant\n{rest}<|im_end|>\n")


def train_tokenizer(texts: list[str], out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts[: max(1, len(texts) // 3)], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>", mask_token="<|mask|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return fast


# -- target -----------------------------------------------------------------------------------
def make_target():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER,
                      num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=64, max_position_embeddings=2048, tie_word_embeddings=True,
                      rope_theta=10000.0, bos_token_id=0, eos_token_id=[0, 2], pad_token_id=0,
                      attn_implementation="sdpa")
    return Qwen3ForCausalLM(cfg)


def batches(tokens: torch.Tensor, bs: int, seq: int, gen: torch.Generator):
    while True:
        starts = torch.randint(0, tokens.numel() - seq - 1, (bs,), generator=gen)
        yield torch.stack([tokens[s:s + seq + 1] for s in starts.tolist()])


def train_target(model, tokens: torch.Tensor, seconds: float, dev) -> None:
    model.to(dev).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.05,
                            fused=DEV_TYPE == "cuda")
    gen = torch.Generator().manual_seed(0)
    it = batches(tokens, 64, SEQ, gen)
    t0, step = time.time(), 0
    while (el := time.time() - t0) < seconds:
        for grp in opt.param_groups:
            grp["lr"] = lr_at(el, seconds, 3e-3)
        x = next(it).to(dev, non_blocking=True)
        with mixed_precision(DEV_TYPE):
            logits = model(input_ids=x[:, :-1]).logits
        loss = F.cross_entropy(logits.float().view(-1, VOCAB), x[:, 1:].reshape(-1))
        optimizer_step(opt, loss, model)
        step += 1
        if step % 200 == 0:
            log(f"target step {step} loss {loss.item():.3f} ({el:.0f}s)")
    log(f"target: {step} steps of 64 x {SEQ} tokens")
    model.eval()


@torch.no_grad()
def eval_loss(model, tokens: torch.Tensor, dev) -> float:
    gen = torch.Generator().manual_seed(1)
    it = batches(tokens, 32, SEQ, gen)
    tot = 0.0
    for _ in range(8):
        x = next(it).to(dev)
        with mixed_precision(DEV_TYPE):
            logits = model(input_ids=x[:, :-1]).logits
        tot += F.cross_entropy(logits.float().view(-1, VOCAB), x[:, 1:].reshape(-1)).item()
    return tot / 8


# -- drafter data and training ----------------------------------------------------------------
@torch.no_grad()
def target_continuations(model, tokens: torch.Tensor, n: int, prompt_len: int, new: int, dev,
                         batch: int = 256, seed: int = 2, sampled_every: int = 4):
    """n sequences: a corpus window of prompt_len tokens and the target's own continuation
    (greedy; one batch in `sampled_every` at T = 1, none if 0)."""
    gen = torch.Generator().manual_seed(seed)
    seqs = []
    for i in range(0, n, batch):
        starts = torch.randint(0, tokens.numel() - prompt_len - 1, (min(batch, n - i),), generator=gen)
        prompts = torch.stack([tokens[s:s + prompt_len] for s in starts.tolist()]).to(dev)
        sample = sampled_every > 0 and (i // batch) % sampled_every == sampled_every - 1
        kw = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0) if sample else dict(do_sample=False)
        out = model.generate(prompts, max_new_tokens=new, min_new_tokens=new, pad_token_id=0,
                             eos_token_id=None, **kw)
        seqs.append(out.cpu())
        log(f"continuations {i + len(starts)}/{n}")
    return torch.cat(seqs)


# -- export -----------------------------------------------------------------------------------
def write_prompts(held: list[Path], out: Path, n_plain: int = 24, n_chat: int = 8) -> None:
    """Plain and chat prompts from snippets of held-out files (files may repeat at other
    offsets when few are held out)."""
    rng = random.Random(7)
    files = sorted(held)
    rows = []
    for i in range(n_plain + n_chat):
        p = files[i % len(files)]
        lines = p.read_text(errors="ignore").splitlines()
        start = rng.randint(0, max(0, len(lines) - 30))
        snippet = "\n".join(lines[start:start + rng.randint(8, 20)]) + "\n"
        if i < n_plain:
            rows.append(dict(kind="plain", source=p.name, prompt=snippet))
        else:
            rows.append(dict(kind="chat", source=p.name, messages=[dict(
                role="user", content=f"Continue this Python code from {p.name}:\n{snippet}")]))
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))


def main() -> None:
    global DEV_TYPE, TAPS, LAYERS, DRAFT_LAYERS, SEQ
    ap = Parser(prog="train_testbed", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=Path("/tmp/testbed_work"))
    ap.add_argument("--out", type=Path, default=Path("testbed"))
    ap.add_argument("--target-seconds", type=positive_float, default=200)
    ap.add_argument("--drafter-seconds", type=positive_float, default=200)
    ap.add_argument("--corpus", choices=["stdlib", "all"], default="all",
                    help="stdlib: v1's corpus (2.8 M tokens); all: + installed packages (~18 M)")
    ap.add_argument("--gen-seqs", type=positive_int, default=4096,
                    help="target continuations for the drafter")
    ap.add_argument("--gen-batch", type=positive_int, default=256, help="continuations generated per batch")
    ap.add_argument("--real-seqs", type=non_negative_int, default=0,
                    help="corpus windows added to the drafter data (v1: as many as --gen-seqs)")
    ap.add_argument("--drafter-batch", type=positive_int, default=32)
    ap.add_argument("--held-seqs", type=positive_int, default=128,
                    help="continuations of held-out files for the drafter's held-out accuracy")
    ap.add_argument("--taps", type=index_list, default=[1, 2],
                    help="target layers feeding the drafter, e.g. 1,3")
    ap.add_argument("--target-layers", type=positive_int, default=LAYERS,
                    help=f"target decoder layers (v1-v3: {LAYERS})")
    ap.add_argument("--draft-layers", type=positive_int, default=DRAFT_LAYERS,
                    help=f"drafter decoder layers (v1-v3: {DRAFT_LAYERS})")
    ap.add_argument("--sampled-every", type=non_negative_int, default=4,
                    help="one continuation batch in N is sampled at T = 1, the rest greedy (0: none)")
    ap.add_argument("--anchor-min", type=positive_int, default=1,
                    help="first anchor position for drafter training (64: continuation only)")
    ap.add_argument("--soft-weight", type=finite_float, default=0.0,
                    help="share of the drafter loss taken against the target's distribution (0..1)")
    ap.add_argument("--drafter-lr", type=positive_float, default=2e-3)
    ap.add_argument("--keep-best", action="store_true",
                    help="check the drafter on fresh continuations of training files every 1000 "
                         "steps and keep the best checkpoint")
    ap.add_argument("--init-from", type=Path,
                    help="an exported testbed: keep its tokenizer and target, start the drafter "
                         "from its weights (its layer counts and taps replace the flags)")
    ap.add_argument("--finish-by", type=non_negative_float, default=0,
                    help="Unix time by which the run must have exported: the drafter stage is "
                         "shortened to fit (for device calls with a hard limit)")
    ap.add_argument("--tokenize-only", action="store_true",
                    help="stop after the tokenizer and the token cache (to share them between runs)")
    ap.add_argument("--max-files", type=non_negative_int, default=0, help="limit the corpus (smoke tests)")
    ap.add_argument("--seq-len", type=positive_int, default=SEQ,
                    help=f"training sequence length, continuations included (v1-v3: {SEQ}; "
                         "smoke tests: shorter)")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    TAPS, LAYERS, DRAFT_LAYERS = tuple(args.taps), args.target_layers, args.draft_layers
    if args.seq_len < 64:
        ap.error(f"--seq-len must be at least 64 (a 16-token prompt and room for 16 blocks); "
                 f"got {args.seq_len}")
    SEQ = args.seq_len
    prompt_len = min(64, SEQ // 4)
    if args.init_from:
        try:
            tcfg = json.loads((args.init_from / "target" / "config.json").read_text())
            init_cfg = load_dflash_config(args.init_from / "drafter")
            LAYERS = int(tcfg["num_hidden_layers"])
        except (OSError, KeyError, ValueError, NotADFlashCheckpoint) as exc:
            ap.error(f"--init-from {args.init_from} is not an exported testbed: {exc}")
        DRAFT_LAYERS, TAPS = init_cfg.num_hidden_layers, init_cfg.target_layer_ids
    if not 0.0 <= args.soft_weight <= 1.0:
        ap.error(f"--soft-weight must be in 0..1; got {args.soft_weight}")
    if args.anchor_min + BLOCK + 16 > SEQ:
        ap.error(f"--anchor-min must leave room for 16 blocks: at most {SEQ - BLOCK - 16}; "
                 f"got {args.anchor_min}")
    if untappable_layers(TAPS, LAYERS):
        ap.error(f"--taps must name target layers 0..{LAYERS - 2} (not the last); got {args.taps}")
    require_cuda(args.device)  # after the flag checks, which need no device
    dev = torch.device(args.device)
    DEV_TYPE = dev.type
    torch.backends.cuda.matmul.allow_tf32 = True
    args.work.mkdir(parents=True, exist_ok=True)
    tdir, ddir = args.out / "target", args.out / "drafter"
    train_files, held = corpus_files(args.corpus)
    if args.max_files:
        train_files, held = train_files[: args.max_files], held[: max(8, args.max_files // 8)]
    log(f"corpus: {len(train_files)} train files, {len(held)} held out")

    rng = random.Random(0)
    texts = []
    for p in train_files:
        t = p.read_text(errors="ignore")
        texts.append(t)
        if rng.random() < 0.25:
            texts.append(chat_sample(p.name, t, rng))
    if args.init_from and not (tdir / "tokenizer.json").exists():
        shutil.copytree(args.init_from / "target", tdir, dirs_exist_ok=True)
    if (tdir / "tokenizer.json").exists():
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(tdir)
    else:
        tok = train_tokenizer(texts, tdir)
    mask_id = tok.convert_tokens_to_ids("<|mask|>")
    tok_cache = args.work / "tokens.pt"
    if tok_cache.exists():
        tokens = torch.load(tok_cache)
    else:
        enc = [e.ids for e in tok.backend_tokenizer.encode_batch(texts, add_special_tokens=False)]
        eot = tok.convert_tokens_to_ids("<|endoftext|>")
        tokens = torch.tensor([i for ids in enc for i in ids + [eot]], dtype=torch.long)
        torch.save(tokens, tok_cache)
    held_tokens = encode_files(tok, held)
    log(f"tokens: train {tokens.numel():,} held-out {held_tokens.numel():,}")
    if args.tokenize_only:
        return

    from transformers import Qwen3ForCausalLM
    ckpt = args.work / "target"
    if (ckpt / "config.json").exists() or args.init_from:
        src = ckpt if (ckpt / "config.json").exists() else args.init_from / "target"
        model = Qwen3ForCausalLM.from_pretrained(src, dtype=torch.float32,
                                                 attn_implementation="sdpa").to(dev).eval()
        log(f"target from {src}")
    else:
        model = make_target()
        log(f"target params: {sum(p.numel() for p in model.parameters()):,}")
        train_target(model, tokens, args.target_seconds, dev)
        model.save_pretrained(ckpt)
    log(f"target held-out loss {eval_loss(model, held_tokens, dev):.3f}")

    data = args.work / "drafter_data.pt"
    if data.exists():
        seqs = torch.load(data)
    else:
        seqs = target_continuations(model, tokens, args.gen_seqs, prompt_len, SEQ - prompt_len, dev,
                                    args.gen_batch, sampled_every=args.sampled_every)[:, :SEQ]
        if args.real_seqs:
            gen = torch.Generator().manual_seed(5)
            starts = torch.randint(0, tokens.numel() - SEQ, (args.real_seqs,), generator=gen)
            seqs = torch.cat([seqs, torch.stack([tokens[s:s + SEQ] for s in starts.tolist()])])
        torch.save(seqs, data)
    log(f"drafter data: {tuple(seqs.shape)}")
    held_seqs = target_continuations(model, held_tokens, args.held_seqs, prompt_len,
                                     SEQ - prompt_len, dev,
                                     args.gen_batch, seed=9)

    dckpt = args.work / "drafter"
    dcfg = DFlashConfig(hidden_size=HIDDEN, num_hidden_layers=DRAFT_LAYERS, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=64, intermediate_size=DRAFT_INTER,
                        vocab_size=VOCAB, rms_norm_eps=1e-6, rope_theta=10000.0,
                        block_size=BLOCK, mask_token_id=mask_id, target_layer_ids=TAPS,
                        num_target_layers=LAYERS)
    if (dckpt / "config.json").exists():
        drafter = DFlashDrafter.from_pretrained(dckpt, device=dev)
    else:
        if args.init_from:
            drafter = DFlashDrafter.from_pretrained(args.init_from / "drafter", device=dev)
            log(f"drafter starts from {args.init_from / 'drafter'}")
        else:
            drafter = DFlashDrafter(dcfg)
            with torch.no_grad():  # start the final norm like the target's
                drafter.norm.weight.copy_(model.model.norm.weight)
        log(f"drafter params: {sum(p.numel() for p in drafter.parameters()):,}")
        seconds = args.drafter_seconds
        if args.finish_by:  # leave ~45 s for the held-out check and the export
            seconds = max(10.0, min(seconds, args.finish_by - time.time() - 45))
            log(f"drafter stage: {seconds:.0f} s (--drafter-seconds {args.drafter_seconds:.0f})")
        val = None
        if args.keep_best:  # training files, other offsets: never the held-out files
            val = target_continuations(model, tokens, args.held_seqs, prompt_len, SEQ - prompt_len,
                                       dev,
                                       args.gen_batch, seed=13, sampled_every=0)
        train_drafter(model, drafter, seqs, seconds, dev, args.drafter_batch, held_seqs,
                      args.drafter_lr, args.anchor_min, args.soft_weight, val)
        drafter.save_pretrained(dckpt, dtype=torch.float32)
    acc = drafter_accuracy(model, drafter, held_seqs, dev)
    log("drafter held-out top-1 accuracy by position: " + " ".join(f"{a:.2f}" for a in acc))

    # export fp16, Hugging Face layout
    model.to(torch.float16).save_pretrained(tdir)
    cfg = json.loads((tdir / "config.json").read_text())
    cfg["torch_dtype"] = cfg["dtype"] = "float16"
    (tdir / "config.json").write_text(json.dumps(cfg, indent=2))
    tok.save_pretrained(tdir)
    drafter.save_pretrained(ddir, dtype=torch.float16,
                            extra_config={"max_position_embeddings": 2048})
    write_prompts(held, args.out / "prompts.jsonl")
    model.float()
    size = sum(f.stat().st_size for f in args.out.rglob("*") if f.is_file())
    log(f"exported to {args.out}: {size / 2**20:.2f} MiB")


if __name__ == "__main__":
    sys.exit(run(main, "train_testbed"))
