"""The planner's GPU step model against measured GPU steps (issue 24), offline from Vidur's published tables.

    python bench/checks/planner_gpu_check.py                       # tables in data/gpu_profiles/vidur
    python bench/checks/planner_gpu_check.py --tables DIR --out bench/out/planner-gpu-check

What it composes, fits and compares, and why: cluster/planner/calibrate/gpu_check.py (this script is its
command line: the tables, the H100 mode, the printout and the verdict). Bands (the issue's acceptance):
median 0.9-1.1, every case 0.75-1.33, for TP 1/2/4, fitted and held-out; exit 0 when met.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # plain script folder: make `cluster` importable without an install
    sys.path.insert(0, str(ROOT))

from cluster.planner.calibrate.gpu_check import (CASE_BAND, DEFAULT_TABLES, H100_LINKS, H100_MODES,  # noqa: E402
                                                MEDIAN_BAND, case_table, groups, run, summary, summary_table)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tables", type=Path, default=DEFAULT_TABLES, help="Vidur tables (default: data/gpu_profiles/vidur)")
    ap.add_argument("--h100", default="links", choices=H100_MODES,
                    help="H100 constants: links (default): compute carried from the A100 fit by its datasheet, "
                         "all-reduce from the H100 NVSwitch's own curve (the hardware entry's); carried: the link "
                         "too, by the NVLink ratio; entry: deploy/hardware.yaml's H100 block, fitted on the H100 "
                         "rows (in-sample)")
    ap.add_argument("--out", type=Path, help="also write check.md and check.json here")
    ap.add_argument("--summary-only", action="store_true")
    args = ap.parse_args(argv)
    cases, report = run(args.tables, args.h100)
    text = ("" if args.summary_only else case_table(cases) + "\n\n") + summary_table(cases)
    print(text)
    if args.h100 == "links":
        print(f"\nH100: compute constants carried from the A100 fit by datasheet (held out); collectives: {H100_LINKS}, "
              "the table its TP cases' measured all-reduces come from (that one term in-sample; --h100 carried: none)")
    accept = [summary(cs) for name, cs in groups(cases) if name.endswith("TP 1/2/4") and "only" not in name]
    ok = all(s["pass"] for s in accept)
    print(f"\nacceptance (median {MEDIAN_BAND[0]}-{MEDIAN_BAND[1]}, every case {CASE_BAND[0]}-{CASE_BAND[1]}, "
          f"TP 1/2/4, fitted and held-out): {'met' if ok else 'NOT met'}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "check.md").write_text(text + "\n")
        (args.out / "check.json").write_text(json.dumps({"cases": [dict(vars(c), ratio=c.ratio) for c in cases],
                                                         "fit": report}, indent=1, default=str))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
