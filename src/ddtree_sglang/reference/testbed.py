"""Loading the shipped testbed (testbed/target, testbed/drafter, testbed/prompts.jsonl)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path
from urllib.parse import unquote, urlparse

import torch

from ddtree_sglang.reference.drafter import DFlashDrafter
from ddtree_sglang.reference.loop import ReferenceSpeculator

# The testbed's 8 MB of weights stay in the source tree, out of the wheel that every GPU server
# installs: a clone (or an editable install) finds it beside src/, `pip install .` in a clone
# through the folder pip recorded (installed_from).
SOURCE_TESTBED = Path(__file__).resolve().parents[3] / "testbed"
WHERE_TESTBED = ("the shipped testbed pair (8 MB) is the testbed/ folder of a ddtree-sglang "
                 "clone, not in the wheel: pass --testbed CLONE/testbed, or install from the "
                 "clone (pip install CLONE)")


def installed_from() -> Path | None:
    """The local folder `pip install PATH` installed this package from (PEP 610's
    direct_url.json), or None (an index or archive install, or no record)."""
    try:
        record = distribution("ddtree-sglang").read_text("direct_url.json")
    except PackageNotFoundError:
        return None
    try:
        url = urlparse(json.loads(record or "{}").get("url", ""))
    except (json.JSONDecodeError, AttributeError):
        return None
    return Path(unquote(url.path)) if url.scheme == "file" else None


def find_testbed() -> Path | None:
    """The source tree's testbed/: beside the package, else in the folder pip installed it
    from, if that folder is still there; None after an install from a wheel."""
    clone = installed_from()
    for path in (SOURCE_TESTBED, clone and clone / "testbed"):
        if path and path.is_dir():
            return path
    return None


# load_testbed()'s default; where none is found, loading it names WHERE_TESTBED.
DEFAULT_TESTBED = find_testbed() or SOURCE_TESTBED


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


class TestbedError(ValueError):
    """A testbed folder or prompts file that cannot be used; the message names the file."""

    __test__ = False  # not a pytest class


def read_prompts(path: str | Path) -> list[dict]:
    """Rows of a prompts.jsonl: {"prompt": text} or {"kind": "chat", "messages": [...]}."""
    p = Path(path)
    if not p.is_file():
        raise TestbedError(f"{p}: prompts file not found")
    rows = []
    for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TestbedError(f"{p} line {n}: not valid JSON ({exc.msg})") from None
        chat = isinstance(row, dict) and row.get("kind") == "chat" and \
            isinstance(row.get("messages"), list) and row["messages"] and \
            isinstance(row["messages"][-1], dict) and "content" in row["messages"][-1]
        if not (chat or (isinstance(row, dict) and isinstance(row.get("prompt"), str))):
            raise TestbedError(f"{p} line {n}: expected {{\"prompt\": text}} or "
                               f"{{\"kind\": \"chat\", \"messages\": [...]}}")
        rows.append(row)
    if not rows:
        raise TestbedError(f"{p}: no prompts in the file")
    return rows


def load_testbed(path: str | Path = DEFAULT_TESTBED, device: str = "cpu",
                 dtype: torch.dtype = torch.float32) -> Testbed:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = Path(path)
    if not root.is_dir():
        shipped = find_testbed()
        where = f"the shipped one is {shipped}" if shipped else WHERE_TESTBED
        raise TestbedError(f"{root}: no such directory (a testbed holds target/, drafter/ and "
                           f"prompts.jsonl; {where})")
    for need in ("target/config.json", "drafter/config.json", "prompts.jsonl"):
        if not (root / need).is_file():
            raise TestbedError(f"{root}: {need} is missing (a testbed holds target/, drafter/ "
                               f"and prompts.jsonl)")
    prompts = read_prompts(root / "prompts.jsonl")
    tok = AutoTokenizer.from_pretrained(root / "target")
    target = AutoModelForCausalLM.from_pretrained(root / "target", dtype=dtype,
                                                  attn_implementation="sdpa").to(device).eval()
    drafter = DFlashDrafter.from_pretrained(root / "drafter", dtype=dtype, device=device)
    eos = tuple(t for t in (tok.convert_tokens_to_ids("<|endoftext|>"),
                            tok.convert_tokens_to_ids("<|im_end|>")) if t is not None)
    return Testbed(ReferenceSpeculator(target, drafter, eos_token_ids=eos), tok, prompts)
