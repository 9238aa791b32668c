"""Native CPU kernels in C (`engine/kernels/cpu/csrc/*.c`), compiled with the machine's C compiler on first use and
loaded with ctypes; `library(name)` returns the loaded library or None when it cannot run here.

Why C next to numba (`cpu_kernels.py`): some kernels need one specific instruction (AVX512-BF16's
vdpbf16ps: 32 bf16 products summed in float32) in a register-blocked loop, which numba cannot express.
Each kernel has a pure-torch path beside it, so a machine without a compiler or without the instruction
set only runs slower: `library()` returns None when
  - PDSERVE_NATIVE=0 is set (A/B runs, tests of the fallback),
  - the CPU lacks what the library's `pd_cpu_supported()` checks,
  - no compiler is found or compiling fails (the reason is logged once).
Build: `cc -O3 -shared -fPIC <flags>` into the cache directory (`PDSERVE_CACHE`, as the GGUF conversions),
named by a hash of the source and flags, written to a temporary file and renamed into place under a file
lock, so concurrent worker processes neither compile twice nor load a half-written file.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch
from filelock import FileLock

from engine.loader import cache_root

log = logging.getLogger(__name__)
SOURCES = Path(__file__).resolve().parent / "csrc"
# ISA extensions a library is compiled for; the library checks at run time that the CPU has them.
_AVX512_BF16 = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mfma"]
FLAGS = {"attention_bf16": _AVX512_BF16, "decode_attention_bf16": _AVX512_BF16, "swiglu_bf16": _AVX512_BF16,
         "quest_select_bf16": _AVX512_BF16}
_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
# The exported functions' ctypes signatures, set once when a library loads: (restype, argtypes).
SIGNATURES = {
    "attention_bf16": {"pd_prefill_work_bytes": (_I, [_I, _I, _I]),
                       "pd_prefill_attention_bf16": (None, [_P, _I, _P, _P, _I, _P, _I, _P, _I, _I, _I, _I, _I,
                                                            _F, _P, _P])},
    "decode_attention_bf16": {"pd_decode_work_bytes": (_I, [_I, _I]),
                              "pd_decode_attention_bf16": (None, [_P, _P, _P, _I, _P, _I, _P, _I, _I, _I, _I, _F, _P,
                                                                  _P])},
    "quest_select_bf16": {"pd_quest_select_work_bytes": (_I, [_I, _I]),
                          "pd_quest_select_bf16": (None, [_P, _P, _P, _P, _I, _I, _I, _I, _P, _P, _P, _P, _P, _P, _P,
                                                          _I, _I, _P, _P, _P, _P])},
    "swiglu_bf16": {"pd_swiglu_bf16": (None, [_P, _I, _I, _P])},
}


def enabled() -> bool:
    return os.environ.get("PDSERVE_NATIVE", "1") != "0"


@functools.lru_cache(maxsize=None)
def _load(name: str) -> ctypes.CDLL | None:
    try:
        path = _build(name)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.CalledProcessError, RuntimeError) as e:
        log.warning("native kernel %s unavailable, using the torch path: %s", name, e)
        return None
    lib.pd_cpu_supported.restype = ctypes.c_int
    if not lib.pd_cpu_supported():
        log.info("native kernel %s: this CPU lacks its instruction set, using the torch path", name)
        return None
    for fn, (restype, argtypes) in SIGNATURES.get(name, {}).items():
        getattr(lib, fn).restype, getattr(lib, fn).argtypes = restype, argtypes
    return lib


@functools.lru_cache(maxsize=None)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux lists them (/proc/cpuinfo), empty where that file is missing."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return frozenset(line.partition(":")[2].split())


def library(name: str) -> ctypes.CDLL | None:
    """The compiled library `csrc/<name>.c`, its functions typed per SIGNATURES, or None where it cannot
    run (see the module map)."""
    return _load(name) if enabled() else None


class Workspace:
    """Scratch memory for a kernel, kept across calls (a fresh multi-MB buffer per layer and step would
    fault in new pages each time). One buffer per thread: ctypes releases the GIL during a call, so two
    engines stepping in two threads of one process run their kernels at the same time."""

    def __init__(self):
        self._local = threading.local()

    def get(self, nbytes: int) -> int:
        """Address of at least `nbytes` bytes, 64-byte aligned (the kernels' aligned loads and stores),
        valid until this thread's next `get`."""
        buf = getattr(self._local, "buf", None)
        if buf is None or buf.numel() < nbytes + 64:
            buf = self._local.buf = torch.empty(nbytes + 64, dtype=torch.uint8)
        addr = buf.data_ptr()
        return addr + (-addr) % 64


def _build(name: str) -> Path:
    src = SOURCES / f"{name}.c"
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    flags = ["-O3", "-shared", "-fPIC", *FLAGS.get(name, [])]
    parts = [src.read_bytes()] + [h.read_bytes() for h in sorted(SOURCES.glob("*.h"))]  # shared headers
    key = hashlib.sha256(b"".join(parts) + " ".join(flags).encode()).hexdigest()[:16]
    out_dir = cache_root() / "native"
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / f"{name}-{key}.so"
    with FileLock(str(target) + ".lock"):
        if target.exists():
            return target
        with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
            built = Path(tmp) / target.name
            proc = subprocess.run([cc, *flags, "-o", str(built), str(src)], capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"{cc} failed on {src.name}: {proc.stderr.strip()[-2000:]}")
            os.replace(built, target)
    return target
