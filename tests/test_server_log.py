"""bench/server_log.py: SGLang's decode-batch lines of one measurement."""
from ddtree_bench.server_log import LogWindow, decode_lines, full_load_decode


def line(running, accept, tok_s):
    return (f"[2026-12-05 15:36:37] Decode batch, #running-req: {running}, #token: 14278, token "
            f"usage: 0.05, accept len: {accept}, accept rate: 0.05, cuda graph: True, gen "
            f"throughput (token/s): {tok_s}, #queue-req: 0\n")


def test_full_load_lines_give_the_server_side_rate_and_period():
    text = (line(2, 4.0, 500.0) + line(4, 4.0, 1000.0) + line(4, 4.2, 1200.0)
            + line(4, 4.4, 1100.0) + "[t] Prefill batch, #new-seq: 1\n" + line(3, 4.0, 900.0))
    assert decode_lines(text)[0] == (2, 4.0, 500.0)
    got = full_load_decode(text, 4)
    # periods 4 x 4.0 / 1000 = 16 ms, 4 x 4.2 / 1200 = 14 ms, 4 x 4.4 / 1100 = 16 ms
    assert got == dict(lines=3, gen_tok_s=1100.0, accept_len=4.2, step_ms=16.0,
                       step_ms_p10=14.0)
    assert full_load_decode(text, 8) is None


def test_a_window_reads_only_what_the_logs_gained(tmp_path):
    a, b, missing = tmp_path / "a.log", tmp_path / "b.log", tmp_path / "none.log"
    a.write_text(line(1, 3.0, 100.0))
    window = LogWindow([a, b, missing])
    with open(a, "a") as f:
        f.write(line(1, 4.0, 200.0))
    b.write_text(line(1, 5.0, 300.0))  # created after the window opened: read whole
    assert [x[1] for x in decode_lines(window.read())] == [4.0, 5.0]


def test_report_shows_the_servers_own_step_period_where_logged():
    from ddtree_bench import report

    meta = dict(name="t", device="d", date="x", command="c", replicas=1, max_new_tokens=8,
                temperature=0.0, reference_arm=None)
    row = dict(arm="ddtree-b64", algorithm="DDTREE", budget=64, concurrency=4,
               output_tok_s=1000.0, tpot_p50_ms=1, tpot_p90_ms=1, ttft_p50_ms=1,
               accept_length=4.2, errors=0,
               server_decode=dict(lines=3, gen_tok_s=1100.0, accept_len=4.2, step_ms=16.0))
    md = report.markdown(dict(meta=meta, rows=[row, dict(row, concurrency=8, server_decode=None)],
                              failures={}))
    assert "| server step ms (p10) | server tok/s |" in md
    assert "| 16.0 (; 3 lines) | 1100.0 |" in md and md.count("|  |  |") >= 1
    row["server_decode"]["step_ms_p10"] = 14.0
    md = report.markdown(dict(meta=meta, rows=[row], failures={}))
    assert "| 16.0 (14.0; 3 lines) | 1100.0 |" in md
    assert "server step ms" not in report.markdown(
        dict(meta=meta, rows=[dict(row, server_decode=None)], failures={}))


# A DDTREE server that died at startup (SGLang 0.5.17 at 5333599): the scheduler's traceback,
# then the launcher's own once the scheduler is gone.
CRASH_LOG = """[2026-12-07 14:02:10] Load weight end. elapsed=0.01 s, type=DFlashDraftModel
[2026-12-07 14:02:11] Scheduler hit an exception: Traceback (most recent call last):
  File "/tmp/sglang-site/sglang/srt/managers/scheduler.py", line 4931, in run_scheduler_process
    scheduler = Scheduler(
                ^^^^^^^^^^
  File "src/ddtree_sglang/sglang_plugin/worker.py", line 68, in __init__
    tuple(s.budgets), max_bs=self._max_batch_size(),
                             ^^^^^^^^^^^^^^^^^^^^^^
  File "src/ddtree_sglang/sglang_plugin/worker.py", line 152, in _max_batch_size
    return max(int(self.model_runner.req_to_token_pool.req_to_token.shape[0]), int(graphs))
                   ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
AttributeError: 'NoneType' object has no attribute 'req_to_token'

[2026-12-07 14:02:11] Received sigquit from a child process. It usually means the child failed.
Traceback (most recent call last):
  File "/tmp/sglang-site/sglang/srt/entrypoints/engine.py", line 1703, in _launch_subprocesses
EOFError

During handling of the above exception, another exception occurred:

RuntimeError: Initialization failed. Please see the error messages above.
[2026-12-07 14:02:16] kill_process_tree called: parent_pid=3329, include_parent=True
"""
ROOT_CAUSE = "AttributeError: 'NoneType' object has no attribute 'req_to_token'"


def test_a_crashed_servers_log_gives_its_first_tracebacks_exception_line():
    from ddtree_bench.server_log import first_error_line, log_problem

    assert first_error_line(CRASH_LOG) == log_problem(CRASH_LOG) == ROOT_CAUSE
    # a log tail cut inside the traceback (the harness keeps the last lines of a dead
    # server's log): found by its frames
    tail = "\n".join(CRASH_LOG.splitlines()[6:])
    assert "Traceback" not in tail.split(ROOT_CAUSE)[0]
    assert first_error_line(tail) == ROOT_CAUSE
    # a leak from SGLang's strict idle check; a clean log (warnings with indented lines too)
    leak = line(4, 4.0, 1000.0) + "[t] ValueError: token_to_kv_pool_allocator memory leak " \
        "detected! available_size=10, protected_size=0\n"
    assert log_problem(leak).startswith("[t] ValueError: token_to_kv_pool_allocator memory leak")
    clean = (line(4, 4.0, 1000.0) + "/x/launch_server.py:56: UserWarning: use sglang serve\n"
             "  warnings.warn(\n")
    assert log_problem(clean) is None and first_error_line(clean) is None


def test_a_server_log_names_its_arm():
    from ddtree_bench.server_log import arm_of_log

    assert arm_of_log("e2e/logs/server_ddtree_triton.log") == "ddtree_triton"  # the GPU checks
    assert arm_of_log("ddtree-default-null_r0_gpu0.log") == "ddtree-default-null"  # bench/run.py
    assert arm_of_log("ddtree-b15_r1_gpu2-3.log") == "ddtree-b15"
