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
           "--target-layers", "3", "--draft-layers", "2", "--drafter-batch", "4", "--keep-best",
           "--seq-len", "96"]
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


def test_bad_flags_are_refused(tmp_path, monkeypatch, capsys):
    """Each bad flag ends the script in one line and exit code 2 (run in this process: the
    checks come before any training)."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import train_testbed

    from ddtree_sglang.cli import run

    def run_main(*flags) -> str:
        monkeypatch.setattr(sys, "argv", ["train_testbed", *flags, "--work", str(tmp_path)])
        try:
            code = run(train_testbed.main, "train_testbed")
        except SystemExit as exc:  # the parser's own errors exit from inside main
            code = exc.code
        err = capsys.readouterr().err
        assert code == 2 and len(err.strip().splitlines()) == 1, err  # one line, no traceback
        return err

    assert "--taps must name target layers 0..2 (not the last)" in run_main("--taps", "1,9")
    assert "--taps must name target layers 0..1 (not the last)" in run_main(
        "--taps", "1,3", "--target-layers", "3")
    assert "expected a positive integer; got '0'" in run_main("--draft-layers", "0")
    assert "expected a positive integer; got '0'" in run_main("--gen-batch", "0")
    assert "argument --real-seqs: expected an integer >= 0" in run_main("--real-seqs", "-1")
    assert "argument --drafter-lr: expected a number > 0" in run_main("--drafter-lr", "0")
    assert "--soft-weight must be in 0..1" in run_main("--soft-weight", "1.5")
    assert "--seq-len must be at least 64" in run_main("--seq-len", "32")
    assert "is not an exported testbed" in run_main("--init-from", str(tmp_path / "missing"))


def test_drafter_accuracy_script(tmp_path):
    out = tmp_path / "acc.json"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "drafter_accuracy.py"), "--testbed",
                        str(ROOT / "testbed"), "--seqs", "4", "--files", "8", "--out", str(out),
                        "--seq-len", "128"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.read_text())
    for side in ("train_files", "held_out_files"):
        assert len(res[side]) == 15 and all(0.0 <= a <= 1.0 for a in res[side])
