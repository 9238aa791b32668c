"""The accelerator table: `Hardware` (frozen) from `deploy/hardware.yaml`, looked up by name or alias.

`load_hardware("h100")` -> peak bf16 FLOP/s, HBM bandwidth and size, NVLink/PCIe/inter-node bandwidth
(all in base units here: FLOP/s, bytes/s, bytes), and for GPUs the `step:` block of the GPU step model
(`gpu_constants`, each constant with its source in the YAML). Used by `gpu_latency` / `roofline`, by
`search/configs.py` (memory per device, all-reduce and KV-transfer link speeds) and by `search` (pool placement).
Cost and power (`price_per_hour`, `power`, each with its source and date in the YAML) and Ray's
`accelerator_type` ride along for `cost` (objectives, budgets) and `spec_writer`; `cost.with_overrides`
applies `--price` / `--power`.
"""
from __future__ import annotations

import difflib
import functools
from dataclasses import dataclass, replace
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from cluster.planner.errors import BadConfigError, UnknownHardwareError
from cluster.planner.inputs.gpu_constants import StepConstants, StepEntry
from cluster.planner.inputs.paths import deploy_dir, pydantic_problems, read_data

GB = 1e9
GIB = 1024 ** 3


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_flops: float  # dense bf16 FLOP/s
    hbm_bw: float  # bytes/s
    memory: float  # bytes per device
    nvlink_bw: float  # bytes/s per device per direction; 0: none
    pcie_bw: float
    inter_node_bw: float  # bytes/s per device across nodes
    step: StepConstants | None = None  # the GPU step model's constants (`gpu_constants`); None: roofline only
    accelerator_type: str | None = None  # Ray's name ("A100", "H100"); None: CPUs
    price_per_hour: float | None = None  # USD per device-hour; None: not in the table
    tdp_w: float | None = None  # rated watts per device
    prefill_w: float | None = None  # typical draw while prefilling
    decode_w: float | None = None  # typical draw while decoding

    @property
    def intra_node_bw(self) -> float:
        """Device-to-device bandwidth inside a node: NVLink where present, else PCIe."""
        return self.nvlink_bw or self.pcie_bw

    @property
    def is_cpu(self) -> bool:
        return self.name.startswith("cpu")


class _Price(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    usd: float = Field(ge=0)
    source: str
    date: str


class _Power(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    tdp_w: float = Field(gt=0)
    prefill_w: float | None = Field(None, gt=0)  # None: the TDP
    decode_w: float | None = Field(None, gt=0)
    source: str
    date: str


class _HardwareEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    aliases: list[str] = Field(default_factory=list)
    peak_tflops: float = Field(gt=0)
    hbm_gbs: float = Field(gt=0)
    memory_gib: float = Field(gt=0)
    nvlink_gbs: float = Field(ge=0)
    pcie_gbs: float = Field(gt=0)
    inter_node_gbs: float = Field(gt=0)
    step: StepEntry | None = None
    accelerator_type: str | None = Field(None, min_length=1)
    price_per_hour: _Price | None = None
    power: _Power | None = None


def _table() -> dict[str, _HardwareEntry]:
    path = deploy_dir() / "hardware.yaml"
    try:
        text = path.read_text()
    except OSError:
        text = None  # read_data names the file and the reason
    return dict(_parsed(path, text))


@functools.lru_cache(maxsize=8)
def _parsed(path: Path, text: str | None) -> dict[str, _HardwareEntry]:
    """The table parsed and checked, keyed on the file's path and its whole text: every plan looks the
    table up (YAML + pydantic took ~0.1 s a call), and the text in the key means an edited or another
    deploy/ file is parsed afresh. Safe to share: the entries are frozen; `_table` hands out a copy of the
    dict. A bad file raises, and lru_cache keeps nothing then."""
    data = read_data(path)  # `text` is the key only (None: unreadable, and read_data says why)
    if not isinstance(data, dict):
        raise BadConfigError(f"{path}: expected a mapping of hardware names")
    try:
        return {name: _HardwareEntry.model_validate(v) for name, v in data.items()}
    except ValidationError as e:
        raise BadConfigError(pydantic_problems(path, e)) from None


def known_hardware() -> list[str]:
    return sorted(_table())


def load_hardware(name: str, inter_node_gbs: float | None = None) -> Hardware:
    """Look up `name` (or an alias); `inter_node_gbs` overrides the table's cross-node bandwidth."""
    table = _table()
    key = name.lower()
    by_alias = {a.lower(): n for n, e in table.items() for a in [n, *e.aliases]}
    if key not in by_alias:
        raise UnknownHardwareError(name, sorted(table), difflib.get_close_matches(key, list(by_alias), n=3))
    canon = by_alias[key]
    e = table[canon]
    pw = e.power
    hw = Hardware(canon, e.peak_tflops * 1e12, e.hbm_gbs * GB, e.memory_gib * GIB, e.nvlink_gbs * GB,
                  e.pcie_gbs * GB, e.inter_node_gbs * GB, e.step.constants() if e.step else None,
                  e.accelerator_type, e.price_per_hour.usd if e.price_per_hour else None,
                  pw.tdp_w if pw else None, (pw.prefill_w or pw.tdp_w) if pw else None,
                  (pw.decode_w or pw.tdp_w) if pw else None)
    return replace(hw, inter_node_bw=inter_node_gbs * GB) if inter_node_gbs else hw
