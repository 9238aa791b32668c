"""cluster/bench/external_clients.py and external_results.py (bench/checks/external_clients.py's library)
without a server: the GuideLLM and AIPerf output parsers on outputs recorded from real short runs
(tests/data/external_clients, each file says how it was made), the commands built for both clients, the
before/after baseline, the table's ratios and verdicts, and several runs pooled (--pool)."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from cluster.bench import external_clients as ec
from cluster.bench import external_results as er

DATA = Path(__file__).resolve().parents[1] / "data" / "external_clients"


def load(name: str) -> dict:
    return json.loads((DATA / name).read_text())


def test_guidellm_report_parses_to_its_own_percentiles():
    doc = load("guidellm_0.8.1_benchmarks.json")
    r = er.parse_guidellm(doc, 2.0, 6)
    m = doc["benchmarks"][0]["metrics"]
    ttft, itl = m["time_to_first_token_ms"]["successful"], m["inter_token_latency_ms"]["successful"]
    assert (r.client, r.rate, r.completed, r.sent, r.error) == ("guidellm", 2.0, 6, 6, None)
    assert (r.ttft_p50_ms, r.ttft_p90_ms) == (ttft["percentiles"]["p50"], ttft["percentiles"]["p90"])
    assert (r.itl_p50_ms, r.itl_p90_ms) == (itl["percentiles"]["p50"], itl["percentiles"]["p90"])
    # the mock server it was recorded against answers after 150 ms, then a token every 10 ms
    assert 150 <= r.ttft_p50_ms < 400 and 10 <= r.itl_p50_ms < 30


def test_guidellm_failures_and_malformed_reports():
    doc = load("guidellm_0.8.1_benchmarks.json")
    bad = copy.deepcopy(doc)
    bad["benchmarks"][0]["metrics"]["request_totals"] = {"successful": 4, "errored": 2, "incomplete": 0, "total": 6}
    assert (er.parse_guidellm(bad, 2.0, 6).completed, er.parse_guidellm(bad, 2.0, 6).sent) == (4, 6)
    none_ok = copy.deepcopy(doc)
    for key in ("time_to_first_token_ms", "inter_token_latency_ms"):
        none_ok["benchmarks"][0]["metrics"][key]["successful"]["count"] = 0
    r = er.parse_guidellm(none_ok, 2.0, 6)
    assert r.ttft_p50_ms is None and r.itl_p90_ms is None  # no successful request: no latency, not 0
    assert "expected 1 benchmark, found 0" in er.parse_guidellm({"benchmarks": []}, 2.0, 6).error


def test_aiperf_export_parses_to_its_own_percentiles():
    doc = load("aiperf_0.13.0_profile_export_aiperf.json")
    r = er.parse_aiperf(doc, 2.0, 6)
    ttft, itl = doc["time_to_first_token"], doc["inter_token_latency"]
    assert (r.client, r.completed, r.sent, r.error) == ("aiperf", 6, 6, None)
    assert ttft["unit"] == itl["unit"] == "ms"
    assert (r.ttft_p50_ms, r.ttft_p90_ms, r.itl_p50_ms, r.itl_p90_ms) == (ttft["p50"], ttft["p90"], itl["p50"],
                                                                          itl["p90"])
    assert 150 <= r.ttft_p50_ms < 400 and 10 <= r.itl_p50_ms < 30  # the same mock server as GuideLLM's sample


def test_aiperf_units_errors_and_missing_metrics():
    doc = load("aiperf_0.13.0_profile_export_aiperf.json")
    secs = copy.deepcopy(doc)
    secs["time_to_first_token"] = {"unit": "s", "p50": 0.2, "p90": 0.3}
    secs["error_request_count"] = {"unit": "requests", "avg": 2.0}
    r = er.parse_aiperf(secs, 2.0, 6)
    assert r.ttft_p50_ms == pytest.approx(200.0) and r.ttft_p90_ms == pytest.approx(300.0)
    assert (r.completed, r.sent) == (6, 8)  # more answered than asked for: the sent count follows
    with pytest.raises(ValueError, match="unknown unit"):
        er.parse_aiperf(dict(doc, time_to_first_token={"unit": "fortnights", "p50": 1.0}), 2.0, 6)
    empty = er.parse_aiperf({"error_request_count": {"unit": "requests", "avg": 6.0}}, 2.0, 6)
    assert (empty.completed, empty.sent, empty.ttft_p50_ms) == (0, 6, None)


def test_read_result_finds_the_files_and_keeps_a_run_error(tmp_path):
    (tmp_path / "guidellm@2.json").write_text((DATA / "guidellm_0.8.1_benchmarks.json").read_text())
    nested = tmp_path / "aiperf@2" / "some-run-folder"
    nested.mkdir(parents=True)
    (nested / "profile_export_aiperf.json").write_text((DATA / "aiperf_0.13.0_profile_export_aiperf.json").read_text())
    assert er.read_result("guidellm", 2.0, 6, tmp_path).completed == 6
    assert er.read_result("aiperf", 2.0, 6, tmp_path).source.endswith("profile_export_aiperf.json")
    missing = er.read_result("aiperf", 0.5, 6, tmp_path, "exit 1 (log): boom")
    assert missing.error == "exit 1 (log): boom" and missing.completed == 0
    (tmp_path / "guidellm@1.json").write_text("{not json")
    assert "cannot parse" in er.read_result("guidellm", 1.0, 6, tmp_path).error


def test_client_commands_carry_the_workload():
    scn = ec.guidellm_scenario("http://127.0.0.1:9", "m", "/tok", 0.5, 20, 256, 64, Path("/o.json"), 120.0)["spec"]
    assert scn["profile"] == {"kind": "constant", "rate": [0.5]}
    assert scn["constraints"] == [{"kind": "max_requests", "count": 20}]
    assert scn["data"] == [{"kind": "synthetic_text", "prompt_tokens": 256, "output_tokens": 64}]
    assert scn["backend"]["request_format"] == "/v1/completions" and scn["tokenizer"]["model"] == "/tok"
    assert scn["backend"]["extras"] == {"body": {"temperature": 0.0}}  # greedy, as pdserve bench sends
    argv = ec.aiperf_argv("http://127.0.0.1:9", "m", "/tok", 0.5, 20, 256, 64, Path("/o"), 120.0)
    flag = lambda name: argv[argv.index(name) + 1]  # noqa: E731
    assert (flag("--request-rate"), flag("--arrival-pattern"), flag("--request-count")) == ("0.5", "constant", "20")
    assert (flag("--synthetic-input-tokens-mean"), flag("--synthetic-input-tokens-stddev")) == ("256", "0")
    assert (flag("--output-tokens-mean"), flag("--output-tokens-stddev")) == ("64", "0")
    assert flag("--extra-inputs") == "ignore_eos:true" and flag("--endpoint-type") == "completions"
    assert argv[argv.index("--extra-inputs") + 2] == "temperature:0.0"
    env = ec.client_env()
    assert "PYTHONPATH" not in env and env["HF_HUB_OFFLINE"] == "1"


def row(client, rate, ttft, itl, completed=20, sent=20, error=None):
    return er.ClientResult(client, rate, ttft, ttft * 1.5, itl, itl * 1.2, completed, sent, error)


def test_table_ratios_and_acceptance():
    results = [row("pdserve", 0.5, 200.0, 40.0), row("guidellm", 0.5, 210.0, 42.0), row("aiperf", 0.5, 230.0, 40.0),
               row("pdserve", 1.0, 300.0, 50.0), row("guidellm", 1.0, 300.0, 50.0, completed=19),
               er.ClientResult("aiperf", 1.0, sent=20, error="exit 1 (log): HTTP 400 ignore_eos")]
    md = er.table(results)
    lines = md.splitlines()
    assert lines[2].startswith("| pdserve | 0.5 |") and lines[3].startswith("| guidellm | 0.5 |")
    assert "| 1.05, 1.05 | 1.05, 1.05 | ok |" in lines[3]  # TTFT p50, p90 ratio; ITL p50, p90 ratio
    assert lines[4].endswith("| TTFT p50 x1.15 |")  # 15% off: outside the 10%
    assert lines[6].endswith("| 1 failed |") and "| 19/20 |" in lines[6]
    assert lines[7].endswith("| exit 1 (log): HTTP 400 ignore_eos |") and "| - / - |" in lines[7]
    assert er.verdict(results[3], None) == "ok"  # pdserve's own row is the baseline
    assert er.verdict(results[1], None) == "TTFT p50 x-, ITL p50 x-"  # no baseline at that rate: not accepted


def test_pdserve_rows_use_the_bench_metrics():
    from cluster.bench.metrics import RequestRecord

    recs = [RequestRecord(i, 0.0, 8, 3, sent_s=0.0, chunk_s=[0.1 * (i + 1), 0.1 * (i + 1) + 0.02, 0.1 * (i + 1) + 0.04],
                          chunk_tokens=[1, 1, 1], end_s=1.0, output_tokens=3) for i in range(3)]
    recs.append(RequestRecord(3, 0.0, 8, 3, sent_s=0.0, end_s=0.5, error="HTTP 500: x"))
    r = er.pdserve_result(recs, 0.5)
    assert (r.completed, r.sent) == (3, 4)
    assert r.ttft_p50_ms == pytest.approx(200.0) and r.itl_p50_ms == pytest.approx(20.0)


def test_report_files_and_parse_only_round_trip(tmp_path):
    (tmp_path / "guidellm@2.json").write_text((DATA / "guidellm_0.8.1_benchmarks.json").read_text())
    results = [row("pdserve", 2.0, 160.0, 11.0, 6, 6), er.read_result("guidellm", 2.0, 6, tmp_path)]
    md = er.report(results, tmp_path, {"rates": [2.0], "num_requests": 6})
    summary = (tmp_path / "summary.md").read_text()
    assert summary.count("| guidellm | 2 |") == 1 and md in summary
    rows, run_args = er.reparse(tmp_path)
    assert rows == results and run_args == {"rates": [2.0], "num_requests": 6}


def test_baseline_pools_the_runs_before_and_after_and_flags_a_drifting_machine():
    from cluster.bench.metrics import RequestRecord

    def run(ttft, gap, n=4):
        return [RequestRecord(i, 0.0, 8, 3, sent_s=0.0, chunk_s=[ttft, ttft + gap, ttft + 2 * gap],
                              chunk_tokens=[1, 1, 1], end_s=ttft + 2 * gap, output_tokens=3) for i in range(n)]

    steady = er.pdserve_result(run(0.2, 0.02), 1.0, run(0.21, 0.02))
    assert (steady.completed, steady.sent) == (8, 8) and steady.ttft_p50_ms == pytest.approx(205.0)
    assert steady.drift["ttft_p50_ms"] == pytest.approx(1.05) and er.verdict(steady, None) == "ok"
    busier = er.pdserve_result(run(0.2, 0.02), 1.0, run(0.2, 0.03))  # decode 1.5x slower in the second run
    assert er.verdict(busier, None) == "baseline drifted (after/before): ITL p50 x1.50"
    assert er.pdserve_result(run(0.2, 0.02), 1.0).drift is None  # one run: nothing to compare


def test_pool_takes_one_median_per_client_and_rate_over_every_runs_requests(tmp_path):
    from dataclasses import asdict

    from cluster.bench.metrics import RequestRecord

    for k, (ttft, gap) in enumerate(((0.2, 0.02), (0.22, 0.02))):
        run = tmp_path / f"run{k}"
        (run / "aiperf@1").mkdir(parents=True)
        recs = [RequestRecord(i, 0.0, 8, 3, sent_s=0.0, chunk_s=[ttft, ttft + gap, ttft + 2 * gap],
                              chunk_tokens=[1, 1, 1], end_s=ttft + 2 * gap, output_tokens=3) for i in range(2)]
        (run / "pdserve@1.json").write_text(json.dumps([asdict(r) for r in recs]))
        guide = {"time_to_first_token_ms": 1040 * ttft, "inter_token_latency_ms": 1000 * gap}
        (run / "guidellm@1.json").write_text(json.dumps({"benchmarks": [{"requests": {"successful": [guide] * 2}}]}))
        rec = {"metrics": {"time_to_first_token": {"value": 1500 * ttft}, "inter_token_latency": {"value": 1000 * gap}}}
        lines = [json.dumps(rec)] * 2 + [json.dumps({"metrics": {}})]  # a failed request: no latencies, not counted
        (run / "aiperf@1" / "profile_export.jsonl").write_text("\n".join(lines))
    md = er.pooled([tmp_path / "run0", tmp_path / "run1"])
    assert "| pdserve | 1 | 4 | 210 | 20.0 | 1.00 | 1.00 | yes |" in md  # medians over both runs' requests
    assert "| guidellm | 1 | 4 | 218 | 20.0 | 1.04 | 1.00 | yes |" in md
    assert "| aiperf | 1 | 4 | 315 | 20.0 | 1.50 | 1.00 | no |" in md
