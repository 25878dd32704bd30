"""What a server's own log says: SGLang's decode-batch lines, and why a server failed.

SGLang logs one line every few decode steps with the running requests, the mean accept length
and the generation throughput over those steps.  Lines with the full load running give the
server-side decode rate and step period of a measurement, free of the client's ramp-up,
drain and streaming overhead, so a spread between repeats can be told apart: a server that
really decoded slower, or a client-side difference.

A server that crashed (at startup or under load) logs a Python traceback; one whose KV pool
leaked logs SGLang's strict idle check.  The GPU checks (tests/gpu/e2e_server.py, features.py,
reliability.py) treat either as a failure; `log_problem` gives the line that says why.
"""

from __future__ import annotations

import re
import statistics
from pathlib import Path

TRACEBACK = "Traceback (most recent call last):"
LEAK_WORDS = ("memory leak", "use-after-free", "leak detected")
# server_<arm>.log (the GPU checks), <arm>_r<replica>_gpu<ids>.log (bench/run.py)
LOG_NAME = re.compile(r"^(?:server_)?(?P<arm>.+?)(?:_r\d+_gpu[\d-]+)?\.log$")
DECODE_LINE = re.compile(r"Decode batch, #running-req: (\d+),.*?accept len: ([\d.]+),.*?"
                         r"gen throughput \(token/s\): ([\d.]+)")


def decode_lines(text: str) -> list[tuple[int, float, float]]:
    """(running requests, accept length, generation tokens/s) of every decode-batch line;
    a non-speculative server's lines have no accept length and are skipped."""
    return [(int(m[1]), float(m[2]), float(m[3])) for m in DECODE_LINE.finditer(text)]


def step_period_ms(running: int, accept: float, tok_s: float) -> float:
    """A decode step's period implied by one line: its tokens over the throughput."""
    return running * accept / tok_s * 1e3


def full_load_decode(text: str, running: int) -> dict | None:
    """Medians over the lines with exactly `running` requests in flight (the full load of a
    measurement): lines, server tokens/s, accept length, step period; None without any.
    Also the step period's 10th percentile: on a host-bound server the period moves with the
    host (a host-bound testbed server's period can double from line to line within one cell)
    while its quiet floor is what the step itself costs."""
    rows = [(a, t) for n, a, t in decode_lines(text) if n == running and t > 0]
    if not rows:
        return None
    periods = sorted(step_period_ms(running, a, t) for a, t in rows)
    return dict(lines=len(rows), gen_tok_s=round(statistics.median(t for _, t in rows), 1),
                accept_len=round(statistics.median(a for a, _ in rows), 3),
                step_ms=round(statistics.median(periods), 3),
                step_ms_p10=round(periods[int(0.1 * (len(periods) - 1))], 3))


class LogWindow:
    """The text that server logs gain between construction and read() (one measurement)."""

    def __init__(self, paths: list[Path]) -> None:
        self.paths = [Path(p) for p in paths]
        self.offsets = [p.stat().st_size if p.is_file() else 0 for p in self.paths]

    def read(self) -> str:
        parts = []
        for path, offset in zip(self.paths, self.offsets):
            if path.is_file():
                with open(path, "rb") as f:
                    f.seek(offset)
                    parts.append(f.read().decode(errors="replace"))
        return "".join(parts)


def first_error_line(text: str) -> str | None:
    """The exception line that ends the first Python traceback in `text` (e.g. "AttributeError:
    'NoneType' object has no attribute 'req_to_token'"): the one line a reader needs from a
    crashed server.  A traceback whose head was cut off (a log tail) is still found by its
    `  File "..."` frames.  None without a traceback."""
    in_traceback = False
    for line in text.splitlines():
        if TRACEBACK in line or line.startswith('  File "'):
            in_traceback = True
        elif in_traceback and line.strip() and not line[0].isspace():
            return line.strip()[:300]
    return None


def log_problem(text: str) -> str | None:
    """Why a server's log says it failed: its first traceback's exception line, else the first
    line naming a traceback or a leak; None for a clean log (the GPU checks' own test:
    "Traceback" or a leak anywhere in it)."""
    words = ("Traceback", *LEAK_WORDS)
    if not any(w in text for w in words):
        return None
    return first_error_line(text) or next(
        line.strip()[:300] for line in text.splitlines() if any(w in line for w in words))


def arm_of_log(name: str) -> str:
    """The arm a server log belongs to, from its file name (LOG_NAME)."""
    m = LOG_NAME.match(Path(name).name)
    return m["arm"] if m else Path(name).stem
