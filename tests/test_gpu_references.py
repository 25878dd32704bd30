"""The references the GPU scripts compare against (tests/gpu/rescoring.py), on the CPU with a
tiny bigram 'model': a wrong reference would make every GPU check meaningless."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
from rescoring import first_divergences, teacher_force  # noqa: E402


class Bigram(torch.nn.Module):
    """logits of position t = table[token t]: next-token scores depend on the last token."""

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(table, requires_grad=False)

    def forward(self, ids: torch.Tensor):
        return SimpleNamespace(logits=self.table[ids])


def model() -> Bigram:
    t = torch.full((5, 5), -5.0)
    t[0, 1] = 2.0            # after 0: 1 clearly
    t[1, 2], t[1, 3] = 1.0, 0.99   # after 1: 2, with 3 a near-tie (0.01 behind)
    t[2, 4] = 3.0
    t[3, 4] = 3.0
    t[4, 0] = 1.0
    return Bigram(t)


def test_first_divergences_name_the_position_tokens_and_float32_gap():
    m = model()
    prompts = [[0], [0], [4]]
    ref = [[1, 2, 4], [1, 2, 4], [0, 1, 2]]
    arm = [[1, 3, 4], [1, 2, 4], [0, 4, 0]]   # prompt 0 splits at a near-tie, 2 at a bad token
    found = first_divergences(m, prompts, arm, ref)
    assert [(d["prompt"], d["position"], d["token"], d["reference_token"]) for d in found] == [
        (0, 1, 3, 2), (2, 1, 4, 1)]
    assert abs(found[0]["gap"] - 0.01) < 1e-5        # within a 0.05 tie tolerance
    assert found[1]["gap"] == 7.0                    # 2.0 - (-5.0): a real difference
    assert first_divergences(m, prompts, ref, ref) == []
    assert len(first_divergences(m, prompts, arm, ref, limit=1)) == 1


def test_teacher_force_counts_near_ties_apart_from_wrong_tokens():
    m = model()
    out = teacher_force(m, [[0], [4]], [[1, 3, 4], [0, 4, 0]], tie_tol=0.05)
    assert out["tokens"] == 6
    assert out["near_ties"] == 1            # 3 after 1
    assert out["not_argmax_beyond_tol"] == 1  # 4 after 0
