"""A stand-in for `python -m sglang.launch_server` used by the benchmark harness tests.

It accepts the same command line, serves /health_generate, /generate (plain and streamed, with
top logprobs), /flush_cache, /get_load and /start_profile on 127.0.0.1, and "generates" a
deterministic function of the prompt, so every arm is lossless unless FAKE_DIVERGE is set for
speculative arms.  /start_profile writes a small Chrome trace of its `num_steps` steps into
`output_dir`, as SGLang does once the steps ran: kernels, and with "CPU" among the activities
the host's CUDA runtime and driver calls (DDTREE servers launch more outside graphs)."""
import argparse
import gzip
import json
import os
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


def next_token(prefix):
    return (sum(prefix) * 31 + len(prefix)) % 1000


def continuation(prompt, n):
    seq = list(prompt)
    for _ in range(n):
        seq.append(next_token(seq))
    return seq[len(prompt):]


def fake_trace(steps: int, activities: list[str], eager: int) -> list[dict]:
    """Per step of 100 us: a graph replay running two kernels, `eager` kernels launched one by
    one (the last through the driver API, as Triton does) and one async copy."""
    events = []
    for k in range(steps):
        t = 100.0 * k
        events += [dict(ph="X", cat="kernel", name="nvjet_tst_128x256", ts=t, dur=30),
                   dict(ph="X", cat="kernel", name="_fwd_kernel_stage1", ts=t + 30, dur=20)]
        events += [dict(ph="X", cat="kernel", name="_tree_kernel", ts=t + 60 + 5 * i, dur=4)
                   for i in range(eager)]
        if "CPU" in activities:
            events.append(dict(ph="X", cat="cuda_runtime", name="cudaGraphLaunch", ts=t, dur=2))
            events += [dict(ph="X", cat="cuda_runtime" if i < eager - 1 else "cuda_driver",
                            name="cudaLaunchKernel" if i < eager - 1 else "cuLaunchKernel",
                            ts=t + 55 + 5 * i, dur=1) for i in range(eager)]
            events.append(dict(ph="X", cat="cuda_runtime", name="cudaMemcpyAsync", ts=t + 90,
                               dur=1))
    return events


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int)
    ap.add_argument("--speculative-algorithm")
    args, _ = ap.parse_known_args()
    print("argv:", " ".join(os.sys.argv[1:]), flush=True)  # the tests read the log
    print("env:", " ".join(f"{k}={v}" for k, v in sorted(os.environ.items())
                           if k.startswith("SGLANG_DDTREE_") or k == "CUDA_VISIBLE_DEVICES"),
          flush=True)
    spec = args.speculative_algorithm
    if spec and os.environ.get("FAKE_FAIL_ALGO") == spec:
        raise SystemExit(f"fake server: refusing {spec} (FAKE_FAIL_ALGO)")
    diverge = spec is not None and os.environ.get("FAKE_DIVERGE") == "1"

    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _json(self, obj, code=200):
            body = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if self.path == "/health_generate":
                self._json({})
            elif self.path == "/get_load":
                self._json([{"num_tokens": 0}])
            elif self.path.startswith("/v1/loads"):
                spec_metrics = ({"accept_length": 2.5, "accept_rate": 0.5}  # != per-request 2.0
                                if spec else None)
                self._json({"loads": [{"dp_rank": 0, "speculative": spec_metrics}]})
            else:
                self._json({"error": "no"}, 404)

        def do_POST(self):
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
            if self.path == "/flush_cache":
                return self._json({})
            if self.path == "/start_profile":
                out = Path(req["output_dir"])
                out.mkdir(parents=True, exist_ok=True)
                events = fake_trace(req["num_steps"], req.get("activities") or ["CPU", "GPU"],
                                    eager=3 if spec == "DDTREE" else 1)
                with gzip.open(out / "fake-TP-0.trace.json.gz", "wt") as f:
                    json.dump({"traceEvents": events}, f)
                return self._json({})
            if self.path == "/v1/completions":
                return self._completions(req)
            p = req["input_ids"]
            sp = req.get("sampling_params", {})
            out = continuation(p, sp.get("max_new_tokens", 8))
            if diverge and len(out) > 3:
                out[3] = (out[3] + 1) % 1000
            meta = {"completion_tokens": len(out)}
            if spec:
                meta.update(spec_accept_length=2.0, spec_verify_ct=max(1, len(out) // 2))
            if req.get("return_logprob"):
                best = next_token(p)
                runner_up = -0.02 if os.environ.get("FAKE_TIE") == "1" else -4.0
                meta["output_top_logprobs"] = [[[-0.01, best, None],
                                                [runner_up, (best + 1) % 1000, None]]]
            if not req.get("stream"):
                return self._json({"output_ids": out, "meta_info": meta})
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for k in range(1, len(out) + 1):
                chunk = {"output_ids": out[:k], "meta_info": meta}
                self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                self.wfile.flush()
            self.wfile.write(b"data: [DONE]\n\n")

        def _completions(self, req):
            """OpenAI completions, streamed, with token ids (SGLang's return_token_ids)."""
            out = continuation(req["prompt"], req.get("max_tokens", 16))
            if diverge and len(out) > 3:
                out[3] = (out[3] + 1) % 1000
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for tok in out:
                chunk = {"choices": [{"index": 0, "text": "t", "token_ids": [tok]}]}
                self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                self.wfile.flush()
            self.wfile.write(b"data: [DONE]\n\n")

    ThreadingHTTPServer.request_queue_size = 256  # a burst of c = 64 connections is accepted
    ThreadingHTTPServer(("127.0.0.1", args.port), H).serve_forever()


if __name__ == "__main__":
    main()
