"""scripts/train_testbed.py end to end at a toy size on CPU: every stage runs, a second call
resumes from the work folder, and the exported pair loads and is lossless in the reference loop."""
import json
import subprocess
import sys
from pathlib import Path

from ddtree_sglang.reference.testbed import load_testbed

ROOT = Path(__file__).resolve().parents[1]


def test_train_testbed_smoke(tmp_path):
    work, out = tmp_path / "work", tmp_path / "tb"
    cmd = [sys.executable, str(ROOT / "scripts" / "train_testbed.py"), "--work", str(work),
           "--out", str(out), "--device", "cpu", "--max-files", "24", "--corpus", "stdlib",
           "--target-seconds", "2", "--drafter-seconds", "2", "--gen-seqs", "8",
           "--gen-batch", "8", "--held-seqs", "4", "--real-seqs", "4", "--taps", "0,1",
           "--target-layers", "3", "--draft-layers", "2", "--drafter-batch", "4", "--keep-best"]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-2000:]
    assert "drafter held-out top-1 accuracy by position" in first.stdout
    assert "drafter: kept step" in first.stdout  # --keep-best selected a checkpoint
    cfg = json.loads((out / "drafter" / "config.json").read_text())
    assert cfg["dflash_config"]["target_layer_ids"] == [0, 1] and cfg["num_hidden_layers"] == 2
    assert json.loads((out / "target" / "config.json").read_text())["num_hidden_layers"] == 3
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=600)  # resumes
    assert again.returncode == 0 and "target params" not in again.stdout
    pair = load_testbed(out)
    prompt = pair.encode(pair.prompts[0])
    ar = pair.speculator.generate(prompt, 12, mode="ar")
    assert pair.speculator.generate(prompt, 12, mode="ddtree", budget=8).tokens == ar.tokens


def test_bad_flags_are_refused(tmp_path):
    def run(*flags):
        return subprocess.run([sys.executable, str(ROOT / "scripts" / "train_testbed.py"), *flags,
                               "--work", str(tmp_path)], capture_output=True, text=True, timeout=300)
    r = run("--taps", "1,9")
    assert r.returncode == 2 and "--taps must name target layers 0..2 (not the last)" in r.stderr
    r = run("--taps", "1,3", "--target-layers", "3")
    assert r.returncode == 2 and "--taps must name target layers 0..1 (not the last)" in r.stderr
    r = run("--draft-layers", "0")
    assert r.returncode == 2 and "expected a positive integer; got '0'" in r.stderr
    r = run("--gen-batch", "0")
    assert r.returncode == 2 and "expected a positive integer; got '0'" in r.stderr
    r = run("--real-seqs", "-1")
    assert r.returncode == 2 and "argument --real-seqs: expected an integer >= 0" in r.stderr
    r = run("--drafter-lr", "0")
    assert r.returncode == 2 and "argument --drafter-lr: expected a number > 0" in r.stderr
    r = run("--soft-weight", "1.5")
    assert r.returncode == 2 and "--soft-weight must be in 0..1" in r.stderr
    r = run("--init-from", str(tmp_path / "missing"))
    assert r.returncode == 2 and "is not an exported testbed" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1  # one line, no usage block, no traceback


def test_drafter_accuracy_script(tmp_path):
    out = tmp_path / "acc.json"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "drafter_accuracy.py"), "--testbed",
                        str(ROOT / "testbed"), "--seqs", "4", "--files", "8", "--out", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.read_text())
    for side in ("train_files", "held_out_files"):
        assert len(res[side]) == 15 and all(0.0 <= a <= 1.0 for a in res[side])
