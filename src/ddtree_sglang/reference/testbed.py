"""Loading the shipped testbed (testbed/target, testbed/drafter, testbed/prompts.jsonl)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ddtree_sglang.reference.drafter import DFlashDrafter
from ddtree_sglang.reference.loop import ReferenceSpeculator

DEFAULT_TESTBED = Path(__file__).resolve().parents[3] / "testbed"


@dataclass
class Testbed:
    speculator: ReferenceSpeculator
    tokenizer: object
    prompts: list[dict]

    def encode(self, row: dict) -> list[int]:
        return encode_prompt(self.tokenizer, row)


def encode_prompt(tokenizer, row: dict) -> list[int]:
    """Token ids of a prompts.jsonl row: plain text, or chat messages + generation prompt
    (the last message's text when the tokenizer has no chat template)."""
    if row.get("kind") == "chat":
        if getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template(row["messages"], add_generation_prompt=True,
                                                tokenize=True)
            return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        return tokenizer.encode(row["messages"][-1]["content"], add_special_tokens=False)
    return tokenizer.encode(row["prompt"], add_special_tokens=False)


def read_prompts(path: str | Path) -> list[dict]:
    return [json.loads(l) for l in Path(path).read_text().splitlines() if l.strip()]


def load_testbed(path: str | Path = DEFAULT_TESTBED, device: str = "cpu",
                 dtype: torch.dtype = torch.float32) -> Testbed:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = Path(path)
    if not (root / "target" / "config.json").is_file():
        raise FileNotFoundError(f"{root}: no testbed here (expected target/, drafter/, prompts.jsonl)")
    tok = AutoTokenizer.from_pretrained(root / "target")
    target = AutoModelForCausalLM.from_pretrained(root / "target", dtype=dtype,
                                                  attn_implementation="sdpa").to(device).eval()
    drafter = DFlashDrafter.from_pretrained(root / "drafter", dtype=dtype, device=device)
    eos = tuple(t for t in (tok.convert_tokens_to_ids("<|endoftext|>"),
                            tok.convert_tokens_to_ids("<|im_end|>")) if t is not None)
    prompts = read_prompts(root / "prompts.jsonl")
    return Testbed(ReferenceSpeculator(target, drafter, eos_token_ids=eos), tok, prompts)
