"""The shipped testbed pair on CPU: it loads, DDTree is lossless on it, and it really accepts."""
import json
from pathlib import Path

import pytest
import torch

from ddtree_sglang.reference.testbed import DEFAULT_TESTBED, load_testbed

MIB = 2**20


@pytest.fixture(scope="module")
def testbed():
    return load_testbed(DEFAULT_TESTBED)


def test_layout_and_size():
    files = [p for p in DEFAULT_TESTBED.rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in files) < 8 * MIB
    for name in ("target/config.json", "target/model.safetensors", "target/tokenizer.json",
                 "drafter/config.json", "drafter/model.safetensors", "prompts.jsonl"):
        assert (DEFAULT_TESTBED / name).is_file(), name
    cfg = json.loads((DEFAULT_TESTBED / "drafter" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["block_size"] == 16
    assert set(cfg["dflash_config"]) == {"target_layer_ids", "mask_token_id"}


def test_chat_template_and_prompts(testbed):
    kinds = {r["kind"] for r in testbed.prompts}
    assert kinds == {"plain", "chat"}
    chat = next(r for r in testbed.prompts if r["kind"] == "chat")
    ids = testbed.encode(chat)
    text = testbed.tokenizer.decode(ids)
    assert text.startswith("<|im_start|>user") and text.rstrip().endswith("<|im_start|>assistant")


@pytest.mark.parametrize("index", [0, 3, 9])
def test_ddtree_greedy_equals_autoregressive_and_accepts(testbed, index):
    spec = testbed.speculator
    prompt = testbed.encode(testbed.prompts[index])
    ar = spec.generate(prompt, 40, mode="ar")
    tree = spec.generate(prompt, 40, mode="ddtree", budget=32)
    chain = spec.generate(prompt, 40, mode="chain")
    assert tree.tokens == ar.tokens and chain.tokens == ar.tokens
    assert tree.tau > 1.0 and chain.tau >= 1.0
    assert tree.target_forwards < ar.target_forwards


def test_pair_accepts_across_prompts(testbed):
    """Over 6 prompts the drafter is really useful: DDTree commits > 1.3 tokens per pass."""
    spec = testbed.speculator
    lens = []
    with torch.no_grad():
        for row in testbed.prompts[:6]:
            lens += spec.generate(testbed.encode(row), 32, mode="ddtree", budget=32).accept_lens
    assert sum(lens) / len(lens) > 1.3


class _Record:
    """A stand-in for an installed distribution holding `direct_url.json` text (or None)."""

    def __init__(self, text):
        self.text = text

    def read_text(self, name):
        assert name == "direct_url.json"
        return self.text


@pytest.mark.parametrize("record, folder", [
    ('{"url": "file:///home/me/ddtree%20sglang", "dir_info": {}}', "/home/me/ddtree sglang"),
    ('{"url": "file:///work/clone", "dir_info": {"editable": true}}', "/work/clone"),
    ('{"url": "https://example.org/ddtree_sglang-0.1.0.tar.gz", "archive_info": {}}', None),
    ('{"url": "git+https://example.org/ddtree-sglang", "vcs_info": {}}', None),
    (None, None),  # an install from an index records no direct URL
    ("not json", None),
])
def test_installed_from_reads_the_folder_pip_recorded(monkeypatch, record, folder):
    """PEP 610: `pip install CLONE` records the clone's folder; anything else is no clone."""
    from ddtree_sglang.reference import testbed as tb

    monkeypatch.setattr(tb, "distribution", lambda name: _Record(record))
    assert tb.installed_from() == (Path(folder) if folder else None)


def test_after_pip_install_of_a_clone_the_demo_finds_the_clone_s_testbed(monkeypatch, tmp_path):
    """The wheel has no testbed (8 MB of weights every server install would carry): the
    package in site-packages finds the one in the clone pip installed it from, and none
    when that clone is gone or the package came from an index."""
    from ddtree_sglang.reference import testbed as tb

    monkeypatch.setattr(tb, "SOURCE_TESTBED", tmp_path / "lib" / "testbed")  # site-packages
    clone = tmp_path / "clone"
    monkeypatch.setattr(tb, "installed_from", lambda: clone)
    assert tb.find_testbed() is None  # the clone is gone
    (clone / "testbed").mkdir(parents=True)
    assert tb.find_testbed() == clone / "testbed"
    monkeypatch.setattr(tb, "installed_from", lambda: None)
    assert tb.find_testbed() is None
    with pytest.raises(tb.TestbedError, match="is the testbed/ folder of a ddtree-sglang clone, "
                                              "not in the wheel: pass --testbed CLONE/testbed"):
        tb.load_testbed(tmp_path / "nowhere")
