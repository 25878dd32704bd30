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
