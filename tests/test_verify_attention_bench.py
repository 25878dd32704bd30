"""benchmarks/verify_attention.py's report (the timings themselves need a GPU): every variant
and tile it times gets a column, and the worst difference per width is reported."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import verify_attention  # noqa: E402


def test_tables_show_every_variant_and_the_worst_difference(capsys):
    row = {"batch": 8, "prefix": 512, "chain_equals_mask": True, "chain-16": 1.5}
    for width in (16, 17, 33):
        for variant in ("tree", "split", "kernel", *verify_attention.TILES):
            row[f"{variant}-{width}"] = float(width)
            if variant != "tree":
                row[f"{variant}-{width}_max_diff"] = 0.004 if variant == "kernel-w8" else 0.001
    verify_attention.print_tables([row], layers=36)
    out = capsys.readouterr().out
    for width in (16, 17, 33):
        assert f"\n{width} tree tokens\n" in out
        assert f"kernel-bm128-n32-{width}" in out
    assert out.count("| 0.001 / 0.004") == 3
    assert "mask layout check): True" in out
