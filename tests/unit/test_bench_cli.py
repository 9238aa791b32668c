"""`pdserve bench` flags: registered by cluster/cli.py, typed errors exit 2 before anything starts."""
from __future__ import annotations

import pytest

from cluster.bench.runner import SLOSetting
from cluster.cli import build_parser, main


def test_bench_is_registered_with_the_issue_flags():
    args = build_parser().parse_args(["bench", "--spec", "deploy/local.yaml", "--rates", "0.5,1,2",
                                      "--ttft-ms", "3x", "--tpot-ms", "150", "--num-requests", "7",
                                      "--duration", "30", "--seed", "4", "--out", "x", "--workload", "azure-code"])
    assert args.rates == [0.5, 1.0, 2.0] and args.num_requests == 7 and args.duration == 30.0 and args.seed == 4
    assert (args.qoe_pace, args.qoe_ttft) == (4.8, 1.0)  # the Andes paper's reading speed
    with pytest.raises(SystemExit):  # one mode only
        build_parser().parse_args(["bench", "--spec", "a.yaml", "--endpoint", "http://x"])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--spec", "a.yaml", "--rate", "1", "--rates", "1,2"])


def test_slo_settings():
    assert SLOSetting.parse("3x") == SLOSetting(3.0, True)
    assert SLOSetting.parse("1.5X") == SLOSetting(1.5, True)
    assert SLOSetting.parse("2000") == SLOSetting(2000.0, False) == SLOSetting.parse("2000ms")
    for bad in ("abc", "0", "-2x", "x"):
        with pytest.raises(ValueError):
            SLOSetting.parse(bad)


@pytest.mark.parametrize("argv, message", [
    (["--spec", "deploy/local.yaml", "--rate", "0"], "rates must be > 0"),
    (["--spec", "deploy/local.yaml", "--workload", "random:foo=1"], "unknown option"),
    (["--spec", "deploy/local.yaml", "--ttft-ms", "fast"], "an SLO is"),
    (["--spec", "deploy/local.yaml", "--qoe-pace", "0"], "QoE pace must be > 0"),
    (["--spec", "deploy/local.yaml", "--qoe-ttft", "-1"], "expected QoE TTFT must be >= 0"),
    (["--spec", "deploy/local.yaml", "--workload", "/no/such/trace.csv"], "no such trace"),
    (["--endpoint", "http://127.0.0.1:9"], "pdserve bench:"),  # nothing listens on the discard port
    (["--endpoint", "http://127.0.0.1:9", "--model", "m", "--extra-body", "[1]"], "JSON object"),
])
def test_bad_input_exits_2_with_a_message(argv, message, tmp_path, capsys):
    assert main(["bench", *argv, "--out", str(tmp_path / "out")]) == 2
    assert message in capsys.readouterr().err
