"""cluster/bench/loadgen.py against a tiny fake OpenAI SSE server (Starlette under uvicorn on 127.0.0.1:0 in
a thread): open loop, token counting, usage, timelines, pdserve options only when asked, failures as
records; then the report writer on the records. Ends with no open stream left on the server."""
from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
import uvicorn
from starlette.applications import Starlette
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

from cluster.bench.loadgen import Target, run_load, run_sequential
from cluster.bench.metrics import request_metrics, summarize
from cluster.bench.workload import RequestSpec


class FakeServer:
    """Streams `max_tokens` one-token chunks. Prompt token 0 selects the behaviour: 1 -> 429, 2 -> an SSE
    error event after one token, 3 -> wait until a request with prompt token 4 has arrived (deadlocks a
    closed-loop client), 5 -> chunks of two tokens, 6 -> first token after 30 s. pdserve options are echoed as a timeline."""

    def __init__(self):
        self.bodies: list[dict] = []
        self.open_streams = 0
        self.saw_4 = None  # asyncio.Event, made on the server's loop
        self.registry = CollectorRegistry()  # /metrics, as pdserve's (cluster/bench/server_stats.py reads it)
        self.prompt_tokens = Counter("pdserve_prompt_tokens", "prompt tokens", registry=self.registry)
        self.stat = Gauge("pdserve_backend_stat", "totals", ["name"], registry=self.registry)
        self.queued = Gauge("pdserve_requests_queued", "state, not a total", registry=self.registry)
        app = Starlette(routes=[Route("/v1/completions", self.completions, methods=["POST"]),
                                Route("/v1/models", self.models), Route("/metrics", self.metrics)])
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    async def models(self, request):
        return JSONResponse({"data": [{"id": "fake"}]})

    async def metrics(self, request):
        return PlainTextResponse(generate_latest(self.registry).decode())

    async def completions(self, request):
        body = await request.json()
        self.bodies.append(body)
        self.prompt_tokens.inc(len(body["prompt"]))
        self.stat.labels("prefix_hit_tokens").inc(2)
        self.queued.set(len(self.bodies))
        if self.saw_4 is None:
            self.saw_4 = asyncio.Event()
        kind = body["prompt"][0]
        if kind == 1:
            return JSONResponse({"error": {"message": "queue full"}}, status_code=429)
        if kind == 4:
            self.saw_4.set()
        return StreamingResponse(self.stream(body, kind), media_type="text/event-stream")

    async def stream(self, body, kind):
        self.open_streams += 1
        try:
            if kind == 3:
                await asyncio.wait_for(self.saw_4.wait(), 20.0)
            if kind == 6:
                await asyncio.sleep(30.0)
            opts = body.get("pdserve") or {}
            n, step = body["max_tokens"], 2 if kind == 5 else 1
            for i in range(0, n, step):
                await asyncio.sleep(0.01)
                ids = list(range(i, min(n, i + step)))
                choice = {"index": 0, "text": "x" * len(ids), "finish_reason": "length" if i + step >= n else None}
                if opts.get("return_token_ids"):
                    choice["token_ids"] = ids
                if opts.get("timeline") and choice["finish_reason"]:
                    choice["timeline"] = {"queued": time.time() - 0.001, "finish": time.time(),
                                          "kv_bytes": 4096.0, "kv_pages": 3.0}  # (counts, not times)
                yield f"data: {json.dumps({'choices': [choice]})}\n\n"
                if kind == 2:
                    yield 'data: {"error": {"message": "worker died"}}\n\n'
                    return
            if (body.get("stream_options") or {}).get("include_usage"):
                usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": n}
                yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            self.open_streams -= 1

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.servers[0].sockets[0].getsockname()[1]}"


@pytest.fixture
def fake():
    srv = FakeServer()
    srv.thread.start()
    end = time.monotonic() + 20
    while not srv.server.started:
        assert time.monotonic() < end, "fake server did not start"
        time.sleep(0.02)
    yield srv
    srv.server.should_exit = True
    srv.thread.join(10)
    assert srv.open_streams == 0, "streams left open on the fake server"


def prompt_of(kinds):
    return lambda s: [kinds[s.index]] + [9] * (s.input_len - 1)


def test_open_loop_records_tokens_usage_and_timelines(fake):
    # request 0 (kind 3) answers only once request 1 (kind 4, sent 0.2 s later) arrived: a closed loop
    # would wait for 0 before sending 1 and time out
    reqs = [RequestSpec(0, 0.0, 8, 5), RequestSpec(1, 0.2, 8, 4), RequestSpec(2, 0.3, 8, 6)]
    target = Target(fake.url, "fake", pdserve=True, timeout_s=30.0)
    recs = asyncio.run(run_load(reqs, prompt_of([3, 4, 5]), target))
    assert [r.error for r in recs] == [None, None, None]
    assert [r.output_tokens for r in recs] == [5, 4, 6]
    assert recs[2].chunk_tokens == [2, 2, 2]  # token ids counted, not chunks
    assert all(r.sent_s >= r.arrival_s for r in recs)
    assert recs[0].chunk_s[0] > recs[1].sent_s  # answered after the later request was sent
    assert all(r.timeline and set(r.timeline) == {"queued", "finish", "kv_bytes", "kv_pages"} for r in recs)
    assert all(r.finish_reason == "length" and r.prompt_tokens == 8 for r in recs)
    ms = [request_metrics(r) for r in recs]
    assert all(m.ok and m.ttft_s > 0 and m.tpot_s > 0 for m in ms)
    b = fake.bodies[0]
    assert b["pdserve"]["ignore_eos"] and b["pdserve"]["timeline"] and b["stream"]
    assert b["max_tokens"] == 5 and b["temperature"] == 0.0 and len(b["prompt"]) == 8


def test_foreign_endpoint_gets_no_pdserve_options_and_failures_become_records(fake):
    reqs = [RequestSpec(i, 0.0, 4, 3) for i in range(4)]
    target = Target(fake.url + "/v1", "fake", extra_body={"ignore_eos": True}, timeout_s=30.0)
    recs = asyncio.run(run_load(reqs, prompt_of([0, 1, 2, 5]), target))
    assert all("pdserve" not in b and b["ignore_eos"] is True for b in fake.bodies)
    ok, http429, stream_err, multi = recs
    assert ok.error is None and ok.output_tokens == 3 and ok.timeline is None
    assert http429.error.startswith("HTTP 429") and not http429.chunk_s
    assert stream_err.error == "stream error: worker died" and stream_err.chunk_s  # a token came first
    # no token ids from a foreign server: one token per text chunk while streaming, usage gives the total
    assert multi.chunk_tokens == [1, 1] and multi.output_tokens == 3
    s = summarize(recs, ttft_slo_s=60.0, tpot_slo_s=60.0)
    assert (s.completed, s.failed) == (2, 2) and s.attainment == pytest.approx(0.5)


def test_client_timeout_and_unreachable_server_fail_the_request(fake):
    reqs = [RequestSpec(0, 0.0, 4, 3)]
    slow = Target(fake.url, "fake", timeout_s=0.5)  # kind 3 waits for a kind-4 request that never comes
    [rec] = asyncio.run(run_load(reqs, prompt_of([3]), slow))
    assert rec.error.startswith("client timeout") and not request_metrics(rec).ok
    fake.saw_4.set()  # let the server-side stream end
    gone = Target("http://127.0.0.1:9", "fake", timeout_s=5.0)
    [rec] = asyncio.run(run_sequential(reqs, prompt_of([0]), gone))
    assert rec.error and "Connect" in rec.error


def test_report_from_fake_runs(fake, tmp_path):
    from cluster.bench.metrics import GoodputResult, RatePoint
    from cluster.bench.report import compare_summary, write_probe, write_report
    from cluster.bench.runner import SLO, BenchConfig, BenchResult, RateRun, SLOSetting, TargetResult
    from cluster.bench.workload import load_workload

    wl = load_workload("random:input=8,output=4", 3)
    target = Target(fake.url, "fake", pdserve=True, timeout_s=30.0)
    cfg = BenchConfig([10.0, 20.0], SLOSetting(3, True), SLOSetting(3, True), progress=False, out_dir=tmp_path)
    result = BenchResult(cfg, wl, SLO(5.0, 1.0, 5.0 / 3, 1.0 / 3, "test"))
    for label in ("a", "b"):
        tr = TargetResult(label, label, None, {})
        for rate in (10.0, 20.0):
            recs = asyncio.run(run_load(wl.at_rate(rate), prompt_of([0, 0, 0]), target))
            tr.runs.append(RateRun(rate, recs, summarize(recs, 5.0, 1.0, cfg.qoe)))
        tr.goodput = GoodputResult(20.0, [RatePoint(10.0, 1.0), RatePoint(20.0, 1.0)], "above")
        result.targets.append(tr)
    result.targets.append(TargetResult("c", "b", None, {}, error="c: the server exited before it was ready\nlog"))
    files = write_report(result, tmp_path, ["a", "b"])
    doc = json.loads(files["json"].read_text())
    assert doc["compare"]["ratio"] == 1.0 and len(doc["compare"]["slo_scale_sweep"]) == len(cfg.slo_scales)
    req = doc["targets"][0]["runs"][0]["requests"][0]
    assert req["output_tokens"] == 4 and set(req["timeline_ms"]) == {"queued", "finish"}
    assert req["kv"] == {"kv_bytes": 4096, "kv_pages": 3}  # the timeline's counts, apart from its times
    # the fake answers within ms, far ahead of a reader expecting 1 s then 4.8 tok/s: QoE 1 everywhere
    assert req["qoe"] == 1.0 and doc["targets"][0]["runs"][0]["summary"]["qoe"]["mean"] == 1.0
    assert doc["config"]["qoe"] == {"ttft_s": 1.0, "tds": 4.8}
    for name in ("attainment_vs_rate", "ttft_cdf", "tpot_cdf", "qoe_cdf", "goodput_vs_slo_scale"):
        assert files[name].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = files["markdown"].read_text()
    assert "Goodput ratio a / b" in md and "| c | - | c: the server exited before it was ready |" in md
    assert "| a | 20 | 1.000 | 1.000 | 1.000 | 1.000 | 1.00 |" in md  # QoE mean, p10, p50, min, share >= 0.9
    assert compare_summary(result, ["a", "missing"]) is None
    probe = json.loads(write_probe(tmp_path, result.targets[0], result.targets[0].runs[1]).read_text())
    assert probe["label"] == "a" and probe["rate"] == 20.0 and len(probe["requests"]) == 3


def test_early_stop_cancels_a_hopeless_probe(fake):
    from cluster.bench.runner import hopeless

    # 10 requests, target 0.9: one certain miss is allowed, the second stops the probe. Requests 0 and 1
    # wait 30 s for a first token (misses once they waited past the 0.5 s TTFT target)
    reqs = [RequestSpec(i, 0.05 * i, 4, 2) for i in range(10)]
    target = Target(fake.url, "fake", timeout_s=60.0)
    recs = asyncio.run(run_load(reqs, prompt_of([6, 6] + [0] * 8), target,
                                stop_when=hopeless(0.5, 10.0, 0.9, len(reqs))))
    assert recs[0].error.startswith("stopped early") and recs[1].error.startswith("stopped early")
    assert all(r.error is None and r.output_tokens == 2 for r in recs[2:])  # they finished before the stop
    assert all(r.end_s is not None for r in recs)
    assert summarize(recs, 0.5, 10.0).attainment == pytest.approx(0.8)
    end = time.monotonic() + 20  # the server sees both slow streams disconnect (long before their 30 s)
    while fake.open_streams:
        assert time.monotonic() < end, "cancelled streams still open on the server"
        time.sleep(0.05)


def test_hopeless_counts_finished_misses_and_overdue_first_tokens():
    from cluster.bench.metrics import RequestRecord
    from cluster.bench.runner import hopeless

    check = hopeless(ttft_s=1.0, tpot_s=0.1, target=0.75, n=4)  # one miss allowed
    fine = RequestRecord(0, 0, 4, 2, sent_s=0.0, chunk_s=[0.5, 0.55], chunk_tokens=[1, 1], end_s=0.6,
                         output_tokens=2)
    slow_tpot = RequestRecord(1, 0, 4, 2, sent_s=0.0, chunk_s=[0.5, 0.9], chunk_tokens=[1, 1], end_s=0.9,
                              output_tokens=2)
    waiting = RequestRecord(2, 0, 4, 2, sent_s=0.0)
    unsent = RequestRecord(3, 5.0, 4, 2)
    assert not check([fine, slow_tpot, waiting, unsent], now=0.9)  # one certain miss
    assert check([fine, slow_tpot, waiting, unsent], now=1.1)  # the waiting one is now past its TTFT
    failed = RequestRecord(3, 0, 4, 2, sent_s=0.0, end_s=0.1, error="HTTP 500: x")
    assert check([fine, slow_tpot, waiting, failed], now=0.2)


def test_min_probe_seconds_send_more_requests_at_higher_rates(fake, tmp_path):
    from cluster.bench.runner import BenchConfig, BenchTarget, SLOSetting, run_bench
    from cluster.bench.workload import load_workload

    wl = load_workload("random:input=8,output=2", 12)  # loaded long enough for the top probe
    cfg = BenchConfig([10.0, 20.0], SLOSetting(60000, False), SLOSetting(60000, False), bisect_steps=0, expand=0,
                      warmup=0, num_requests=3, min_probe_s=0.3, progress=False, out_dir=tmp_path)
    bt = BenchTarget("fake", target=Target(fake.url, "fake", timeout_s=30.0), reference=True)
    [tr] = run_bench(cfg, wl, lambda s: [0] * s.input_len, [bt]).targets
    # 10 req/s x 0.3 s = 3 (= num_requests); 20 req/s x 0.3 s = 6
    assert [(r.rate, r.summary.requests, r.summary.completed) for r in tr.runs] == [(10.0, 3, 3), (20.0, 6, 6)]


def test_run_bench_on_an_endpoint_and_after_ctrl_c(fake, tmp_path):
    from cluster.bench.runner import BenchConfig, BenchTarget, SLOSetting, run_bench
    from cluster.bench.workload import load_workload

    wl = load_workload("random:input=8,output=4", 3)
    # SLOs of 1000x the unloaded p90 (~15 ms): both probes attain them even on a loaded CI machine, so the
    # search always reaches the second rate (3x made the first probe miss under load and stop the search)
    cfg = BenchConfig([10.0, 20.0], SLOSetting(1000, True), SLOSetting(1000, True), bisect_steps=0, expand=0,
                      warmup=1, unloaded_requests=2, progress=False, out_dir=tmp_path)
    probes = []

    def target():
        return BenchTarget("fake", target=Target(fake.url, "fake", pdserve=True, timeout_s=30.0), reference=True)

    result = run_bench(cfg, wl, lambda s: [0] * s.input_len, [target()], lambda t, run: probes.append(run.rate))
    [tr] = result.targets
    assert len(tr.unloaded) == 2 and result.slo.ref_ttft_s > 0 and result.slo.ttft_s == 1000 * result.slo.ref_ttft_s
    assert probes == [10.0, 20.0] and [r.rate for r in tr.runs] == [10.0, 20.0]
    assert all(r.summary.completed == 3 for r in tr.runs) and tr.goodput.points and not result.interrupted
    # the server's counters over each probe: 3 prompts of 8 tokens; state gauges are not diffed
    assert [r.server for r in tr.runs] == [{"pdserve_backend_stat{name=prefix_hit_tokens}": 6.0,
                                           "pdserve_prompt_tokens_total": 24.0}] * 2
    from cluster.bench.report import markdown
    md = markdown(result, None)
    assert "| counter | fake @ 10 | fake @ 20 |" in md and "| prompt_tokens_total | 24 | 24 |" in md

    calls = []

    def interrupt_in_second_probe(spec):
        calls.append(spec)
        if len(calls) > 1 + 2 + 3:  # warm-up, unloaded, first probe
            raise KeyboardInterrupt
        return [0] * spec.input_len

    result = run_bench(cfg, wl, interrupt_in_second_probe, [target()])
    assert result.interrupted and [r.rate for r in result.targets[0].runs] == [10.0]
    assert result.targets[0].goodput is None
