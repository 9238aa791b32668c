"""cluster/bench/workload.py and prompts.py: the real traces (small slices), the seeded synthetic
generator (distribution sanity), rate scaling, `--set` spec variants, prompts of exact token counts."""
from __future__ import annotations

import statistics
from pathlib import Path

import pytest
import yaml

from cluster.bench.prompts import PromptSource
from cluster.bench.server import parse_sets, spec_variants
from cluster.bench.workload import TRACES, TraceScaling, WorkloadError, load_workload, workloads_dir

DATA = Path(__file__).resolve().parents[2] / "data" / "workloads"  # the repository's traces


@pytest.fixture(autouse=True)
def traces(monkeypatch):
    """The traces under data/workloads, whatever PDSERVE_WORKLOADS says in the caller's environment."""
    monkeypatch.delenv("PDSERVE_WORKLOADS", raising=False)
    assert workloads_dir() == DATA and all((DATA / f).is_file() for f in TRACES.values())



def test_azure_code_slice_keeps_gaps_and_scales_lengths():
    w = load_workload("azure-code", 20)
    raw = (workloads_dir() / TRACES["azure-code"]).read_text().splitlines()[1:21]
    ctx = [int(line.split(",")[1]) for line in raw]
    gen = [int(line.split(",")[2]) for line in raw]
    s = TraceScaling()
    assert w.input_lens == [min(1024, max(4, round(c * 0.25))) for c in ctx]
    assert w.output_lens == [min(256, max(1, round(g * 0.5))) for g in gen]
    assert w.native_rate > 0 and w.info["scaling"]["input_scale"] == s.input_scale
    # the first two rows are 52 ms apart in the file: at the trace's own rate the gap is kept
    reqs = w.at_rate(None)
    assert reqs[0].arrival_s == 0.0 and reqs[1].arrival_s == pytest.approx(0.052, abs=1e-6)
    # at twice the trace's rate every gap halves: the pattern is kept
    fast = w.at_rate(2 * w.native_rate)
    assert [r.arrival_s for r in fast] == pytest.approx([r.arrival_s / 2 for r in reqs])
    assert fast[-1].arrival_s == pytest.approx(19 / (2 * w.native_rate))  # mean rate as asked


def test_azure_conv_and_mooncake_slices():
    conv = load_workload("azure-conv", 10, start=5)
    assert len(conv) == 10 and conv.info["start"] == 5
    moon = load_workload("mooncake", 30)
    first = (workloads_dir() / TRACES["mooncake"]).read_text().splitlines()[0]
    assert moon.input_lens[0] == min(1024, round(yaml.safe_load(first)["input_length"] * 0.25))
    arrivals = [r.arrival_s for r in moon.at_rate(3.0)]
    assert arrivals == sorted(arrivals) and arrivals[0] == 0.0
    custom = load_workload("mooncake", 30, scaling=TraceScaling(1.0, 1.0, max_input=100000, max_output=100000))
    assert custom.output_lens[0] == yaml.safe_load(first)["output_length"]


def test_trace_errors_are_typed(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b\n1,2\n")
    with pytest.raises(WorkloadError, match="missing columns"):
        load_workload(str(bad), 5)
    with pytest.raises(WorkloadError, match="no such trace"):
        load_workload(str(tmp_path / "none.csv"), 5)
    jl = tmp_path / "t.jsonl"
    jl.write_text('{"timestamp": 0, "input_length": 10}\n')
    with pytest.raises(WorkloadError, match="Mooncake"):
        load_workload(str(jl), 5)
    with pytest.raises(WorkloadError, match="unknown option"):
        load_workload("random:inptu=5", 5)
    with pytest.raises(WorkloadError, match="needs a rate"):
        load_workload("random", 5).at_rate(None)


def test_synthetic_is_seeded_and_has_the_asked_distributions():
    a = load_workload("random:input=200,output=50,range=0.5", 4000, seed=7)
    b = load_workload("random:input=200,output=50,range=0.5", 4000, seed=7)
    c = load_workload("random:input=200,output=50,range=0.5", 4000, seed=8)
    assert a.input_lens == b.input_lens and a.unit_arrivals_s == b.unit_arrivals_s
    assert a.input_lens != c.input_lens
    assert min(a.input_lens) >= 100 and max(a.input_lens) <= 300
    assert statistics.mean(a.input_lens) == pytest.approx(200, rel=0.03)
    assert statistics.mean(a.output_lens) == pytest.approx(50, rel=0.03)
    gaps = [y - x for x, y in zip(a.unit_arrivals_s, a.unit_arrivals_s[1:])]
    assert statistics.mean(gaps) == pytest.approx(1.0, rel=0.05)  # unit rate
    assert statistics.pstdev(gaps) == pytest.approx(1.0, rel=0.1)  # Poisson: CV 1
    fixed = load_workload("random:input=64,output=8", 50)
    assert set(fixed.input_lens) == {64} and set(fixed.output_lens) == {8}


def test_burstiness_sets_the_gap_cv_and_rate_scales_time():
    bursty = load_workload("random:burstiness=0.25", 4000, seed=1)
    gaps = [y - x for x, y in zip(bursty.unit_arrivals_s, bursty.unit_arrivals_s[1:])]
    assert statistics.pstdev(gaps) / statistics.mean(gaps) == pytest.approx(2.0, rel=0.15)
    same = load_workload("random:cv=2", 4000, seed=1)
    assert same.unit_arrivals_s == bursty.unit_arrivals_s
    at4 = bursty.at_rate(4.0)
    assert [r.arrival_s for r in at4] == pytest.approx([t / 4 for t in bursty.unit_arrivals_s])
    assert len(bursty.at_rate(4.0, duration_s=10.0)) == pytest.approx(40, rel=0.5)
    ln = load_workload("random:input=100,output=10,dist=lognormal,sigma=0.5", 4000, seed=3)
    assert statistics.median(ln.input_lens) == pytest.approx(100, rel=0.05) and max(ln.input_lens) > 200


class WordTokenizer:
    """One token per character: enough to check exact lengths and distinct slices."""

    def encode(self, text):
        return [ord(ch) for ch in text]

    def decode(self, ids):
        return "".join(map(chr, ids))


def test_prompts_have_exact_lengths_and_differ_per_request():
    src = PromptSource(WordTokenizer())
    assert len(src.corpus) > 100_000  # the interpreter's own documentation
    for n in (1, 17, 1000, 3 * len(src.corpus)):
        assert len(src.ids(3, n)) == n
    assert src.ids(0, 64) != src.ids(1, 64)
    assert src.ids(5, 64) == src.ids(5, 64)
    assert src.text(2, 40) == WordTokenizer().decode(src.ids(2, 40))


def test_spec_variants_sweep_only_specs_with_the_key(tmp_path):
    co = tmp_path / "co.yaml"
    co.write_text("mode: colocated\npools:\n  colocated:\n    replicas: 2\n    max_num_batched_tokens: 512\n")
    dis = tmp_path / "dis.yaml"
    dis.write_text("mode: disaggregated\npools:\n  prefill: {replicas: 1}\n  decode: {replicas: 1}\n")
    out = spec_variants([str(dis), str(co)], ["pools.colocated.max_num_batched_tokens=256,1024"], tmp_path)
    assert [v.path for v in out[0]] == [str(dis)]
    assert [v.settings for v in out[1]] == [{"pools.colocated.max_num_batched_tokens": 256},
                                           {"pools.colocated.max_num_batched_tokens": 1024}]
    doc = yaml.safe_load(open(out[1][0].path))
    assert doc["pools"]["colocated"] == {"replicas": 2, "max_num_batched_tokens": 256}
    assert out[1][1].label == "co[max_num_batched_tokens=1024]"
    with pytest.raises(ValueError, match="dotted.key"):
        parse_sets(["nokey"])


def test_trace_stride_thins_the_trace():
    every = load_workload("azure-code", 60)
    thin = load_workload("azure-code", 20, stride=3, start=1)
    assert thin.input_lens == every.input_lens[1::3][:20] and thin.info["stride"] == 3
    with pytest.raises(WorkloadError, match="stride"):
        load_workload("azure-code", 5, stride=0)
