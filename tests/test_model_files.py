"""model_files.py and the README's serve command by hub ID: drafter and target resolved from a
local Hugging Face cache offline, as SGLang resolves them, with errors that say how to fetch."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ddtree_sglang.dflash.files import ModelNotFound, is_hub_id, model_dir

ROOT = Path(__file__).resolve().parents[1]
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def fake_hub(cache: Path, repos: dict[str, Path]) -> Path:
    """A Hugging Face hub cache holding each repo's files at one snapshot, refs/main on it."""
    for repo, src in repos.items():
        d = cache / f"models--{repo.replace('/', '--')}"
        (d / "refs").mkdir(parents=True)
        (d / "refs" / "main").write_text(COMMIT)
        snap = d / "snapshots" / COMMIT
        snap.mkdir(parents=True)
        for f in src.iterdir():
            (snap / f.name).symlink_to(f)
    return cache


def offline_env(cache: Path) -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache),
            "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT / "src")}


def test_hub_ids_and_paths_told_apart():
    assert is_hub_id("z-lab/Qwen3-8B-DFlash-b16") and is_hub_id("gpt2")
    assert not is_hub_id("/models/Qwen3-8B") and not is_hub_id("./drafter")
    assert not is_hub_id("~/x") and not is_hub_id("a/b/c")


def test_local_path_first(tmp_path):
    assert model_dir(str(tmp_path)) == tmp_path
    with pytest.raises(ModelNotFound, match="neither a local directory nor a Hugging Face"):
        model_dir("/no/such/dir")


def test_hub_id_from_the_cache_offline(tmp_path):
    cache = fake_hub(tmp_path / "hub", {"z-lab/Qwen3-8B-DFlash-b16": ROOT / "testbed" / "drafter"})
    code = ("from ddtree_sglang.dflash.files import model_dir; "
            "print(model_dir('z-lab/Qwen3-8B-DFlash-b16'))")
    out = subprocess.run([sys.executable, "-c", code], env=offline_env(cache),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith(f"snapshots/{COMMIT}")
    missing = ("from ddtree_sglang.dflash.files import model_dir; "
               "model_dir('z-lab/Qwen3-4B-DFlash-b16', revision='v2')")
    out = subprocess.run([sys.executable, "-c", missing], env=offline_env(cache),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert re.search(r"revision 'v2' is not in the Hugging Face cache .*HF_HUB_OFFLINE is set.*"
                     r"`hf download z-lab/Qwen3-4B-DFlash-b16 --revision v2`", out.stderr), \
        out.stderr[-800:]


def test_the_fetch_hint_fetches_what_the_server_will_read():
    """The hint's command names the revision and the cache the server was given, so running
    it makes the next start find the files."""
    from ddtree_sglang.dflash.files import fetch_hint

    assert "`hf download a/b`" in fetch_hint("a/b")
    assert "`hf download a/b --revision v2 --cache-dir /data/hf`" in fetch_hint("a/b", "v2",
                                                                                 "/data/hf")


def readme_serve_argv() -> list[str]:
    """The README's serve command, as a user copies it: the arguments after `sglang serve`."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"sglang serve (.*?)\n```", text, re.S)
    assert block, "the README has a `sglang serve` command"
    return block.group(1).replace("\\\n", " ").split()


def test_readme_serve_command_gets_past_ddtree_s_checks_offline(tmp_path):
    """The README's exact command against a fake hub cache holding the testbed pair under the
    README's IDs: `sglang serve` stops at SGLang's own "no accelerator" (its device check runs
    before the speculative one), and the same arguments with --device cuda pass every DDTREE
    check (hub IDs resolved offline), where DDTREE is what refused them before."""
    pytest.importorskip("sglang", reason="the README's command starts SGLang")
    argv = readme_serve_argv()
    ids = dict(zip(argv[::2], argv[1::2]))
    cache = fake_hub(tmp_path / "hub", {
        ids["--model-path"]: ROOT / "testbed" / "target",
        ids["--speculative-draft-model-path"]: ROOT / "testbed" / "drafter"})
    env = offline_env(cache)
    code = ("import sys\nfrom sglang.srt.plugins import load_plugins\nload_plugins()\n"
            "from sglang.srt.server_args import prepare_server_args\n"
            "a = prepare_server_args(sys.argv[1:])\n"
            "print('PASSED', a.speculative_algorithm, a.speculative_num_draft_tokens)")
    runs = {"checks": [sys.executable, "-c", code, *argv, "--device", "cuda"]}
    sglang_cli = Path(sys.executable).parent / "sglang"
    if sglang_cli.exists():
        runs["serve"] = [str(sglang_cli), "serve", *argv]
    procs = {k: subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True) for k, cmd in runs.items()}  # side by side
    out = {k: (p.communicate(timeout=300), p.returncode) for k, p in procs.items()}
    if "serve" in out:
        (_, err), code_ = out["serve"]
        assert code_ != 0 and "No accelerator" in err, err[-1500:]
        assert "DDTREE cannot start" not in err
    (stdout, err), code_ = out["checks"]
    assert code_ == 0 and "PASSED DDTREE 33" in stdout, err[-1500:]
