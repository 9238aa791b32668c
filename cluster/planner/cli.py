"""`pdserve` subcommands of cluster/planner (registered by cluster/cli.py)."""
from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add this subpackage's subcommands; keep it cheap (no heavy imports here)."""
