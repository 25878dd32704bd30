"""Launch `python -m sglang.launch_server` as a child process, wait for health, always stop it.

Each server runs in a process group of its own (SGLang's scheduler and detokenizer are its
children), stopped as a group.  A launcher that dies without stopping its servers (SIGKILL, a
crash in C) leaves them running, so each launch also records its group in the file named by
$DDTREE_SERVER_PIDS when set: `python -m ddtree_bench.server stop-recorded FILE` (what
scripts/gpu_run.sh does on exit) stops exactly those groups and nothing else on the machine.
"""

from __future__ import annotations

import atexit
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path


PIDS_ENV = "DDTREE_SERVER_PIDS"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerSpec:
    """One server: the target, the speculative arm and the settings shared by every arm."""

    model_path: str
    name: str = "plain"
    algorithm: str | None = None  # None, "DFLASH" or "DDTREE"
    draft_model_path: str | None = None
    num_draft_tokens: int | None = None
    attention_backend: str = "triton"
    dtype: str = "float16"
    mem_fraction_static: float = 0.3
    cuda_graph_max_bs: int = 32
    disable_cuda_graph: bool = False
    disable_overlap_schedule: bool = False
    page_size: int = 1
    tp_size: int = 1
    max_running_requests: int | None = None
    # A fixed KV pool size lets several servers share one GPU (SGLang sizes the pool from the
    # memory free at its own start, so servers starting together would otherwise starve).
    max_total_tokens: int | None = None
    sleep_on_idle: bool = False  # idle servers beside a measured one must not spin a CPU core
    extra_args: list[str] = field(default_factory=list)
    launcher_module: str = "sglang.launch_server"  # tests substitute a stand-in server
    env: dict[str, str] = field(default_factory=dict)  # e.g. a DDTREE knob for this arm only

    def launch_env(self, gpu: str | None = None) -> dict[str, str]:
        """The settings a server gets on top of the caller's environment: the arm's knobs and
        its GPUs (CUDA_VISIBLE_DEVICES)."""
        return {**({"CUDA_VISIBLE_DEVICES": str(gpu)} if gpu is not None else {}), **self.env}

    def shell_command(self, port: int, gpu: str | None = None) -> str:
        """The launch as one shell line that runs as printed: env assignments, then the
        command, every word shell-quoted."""
        env = [f"{k}={shlex.quote(v)}" for k, v in self.launch_env(gpu).items()]
        return " ".join([*env, shlex.join(self.cli(port))])

    def cli(self, port: int) -> list[str]:
        args = [sys.executable, "-m", self.launcher_module, "--model-path", self.model_path,
                "--host", "127.0.0.1", "--port", str(port), "--dtype", self.dtype,
                "--attention-backend", self.attention_backend,
                "--mem-fraction-static", str(self.mem_fraction_static),
                "--page-size", str(self.page_size), "--sampling-backend", "pytorch",
                "--cuda-graph-backend-prefill", "disabled",
                "--cuda-graph-max-bs-decode", str(self.cuda_graph_max_bs)]
        if self.algorithm:
            args += ["--speculative-algorithm", self.algorithm,
                     "--speculative-draft-model-path", str(self.draft_model_path)]
            if self.num_draft_tokens:
                args += ["--speculative-num-draft-tokens", str(self.num_draft_tokens)]
        if self.tp_size > 1:
            args += ["--tp-size", str(self.tp_size)]
        if self.disable_cuda_graph:
            args += ["--cuda-graph-backend-decode", "disabled"]
        if self.disable_overlap_schedule:
            args += ["--disable-overlap-schedule"]
        if self.max_running_requests:
            args += ["--max-running-requests", str(self.max_running_requests)]
        if self.max_total_tokens:
            args += ["--max-total-tokens", str(self.max_total_tokens)]
        if self.sleep_on_idle:
            args += ["--sleep-on-idle"]
        return args + self.extra_args


class Server:
    """Context manager around one server process; the log goes to `log_path`."""

    def __init__(self, spec: ServerSpec, log_path: Path, gpu: str | None = None,
                 port: int | None = None, env: dict | None = None) -> None:
        self.spec, self.log_path, self.gpu = spec, Path(log_path), gpu
        self.port = port or free_port()
        self.env = env or {}
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 600.0) -> "Server":
        self.launch()
        return self.wait_healthy(timeout)

    def launch(self) -> None:
        env = {**os.environ, **self.spec.launch_env(self.gpu), **self.env}  # own settings win
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.spec.cli(self.port), stdout=self._log,
                                     stderr=subprocess.STDOUT, env=env, start_new_session=True)
        _LIVE.add(self)
        record = os.environ.get(PIDS_ENV)
        if record:  # its own session: the pid is the process group's id
            with open(record, "a") as f:
                f.write(f"{self.proc.pid}\n")

    def wait_healthy(self, timeout: float) -> "Server":
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server {self.spec.name} exited with {self.proc.returncode}; "
                                   f"log tail:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health_generate", timeout=5) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"server {self.spec.name} not healthy after {timeout}s:\n{self.log_tail()}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="ignore").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        _LIVE.discard(self)
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=30)
        except (subprocess.TimeoutExpired, ProcessLookupError):
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        finally:
            self._log.close()

    def __enter__(self) -> "Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


_LIVE: set[Server] = set()


@atexit.register
def _stop_live() -> None:
    """Servers still up when the interpreter exits (an uncaught error, SystemExit from SIGTERM)
    are stopped: they live in sessions of their own and would outlive us."""
    for server in list(_LIVE):
        server.stop()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:  # a group of another user: not ours to stop
        return False


def stop_recorded(path: Path, grace_s: float = 20.0) -> list[int]:
    """Stop the process groups recorded in `path` (one pid a line, by Server.launch) that are
    still alive: SIGTERM, then SIGKILL after `grace_s`.  Returns the groups that were alive.
    Servers this file does not name (another user's, another run's) are left alone."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return []
    groups = [int(x) for x in text.split() if x.isdigit()]
    alive = [g for g in dict.fromkeys(groups) if _group_alive(g)]
    for g in alive:
        os.killpg(g, signal.SIGTERM)
    deadline = time.time() + grace_s
    while time.time() < deadline and any(_group_alive(g) for g in alive):
        time.sleep(0.2)
    for g in alive:
        if _group_alive(g):
            os.killpg(g, signal.SIGKILL)
    return alive


def stop_servers_on_sigterm() -> None:
    """Turn SIGTERM (e.g. from `timeout`) into SystemExit, so the `finally`/ExitStack blocks that
    stop the servers run: they live in their own process sessions and would outlive us."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def post_json(url: str, payload: dict, timeout: float = 600.0) -> dict:
    req = urllib.request.Request(url, data=json.dumps(payload).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            body = r.read()
        try:
            return json.loads(body)
        except json.JSONDecodeError:  # e.g. /flush_cache answers in plain text
            return {"text": body.decode(errors="ignore")}
    except urllib.error.HTTPError as e:
        return {"error": {"status": e.code, "body": e.read().decode(errors="ignore")}}


def get_json(url: str, timeout: float = 30.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def main(argv: list[str] | None = None) -> int:
    """`python -m ddtree_bench.server stop-recorded FILE`: stop the servers FILE records."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] != "stop-recorded":
        print("usage: python -m ddtree_bench.server stop-recorded FILE", file=sys.stderr)
        return 2
    stopped = stop_recorded(Path(args[1]))
    if stopped:
        print(f"stopped {len(stopped)} server process group(s) left running: "
              f"{' '.join(map(str, stopped))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
