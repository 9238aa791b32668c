"""engine/sdpa_backends.py: the CUDA backend list a user may name, and CPU left to PyTorch's choice."""
from __future__ import annotations

import contextlib

import pytest
import torch
from torch.nn.attention import SDPBackend

from engine.sdpa_backends import DEFAULT, cuda_backends, sdpa_context


def test_default_list_is_flash_efficient_math(monkeypatch):
    monkeypatch.delenv("PDSERVE_CUDA_SDPA", raising=False)
    assert DEFAULT == "flash,efficient,math"
    assert cuda_backends() == [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def test_env_names_another_list(monkeypatch):
    monkeypatch.setenv("PDSERVE_CUDA_SDPA", " cudnn , math ")
    assert cuda_backends() == [SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH]


@pytest.mark.parametrize("spec", ["fast", "flash,turbo", ","])
def test_unknown_names_are_refused_naming_the_variable(spec):
    with pytest.raises(ValueError, match="PDSERVE_CUDA_SDPA"):
        cuda_backends(spec)


def test_cpu_forward_keeps_pytorch_choice():
    assert isinstance(sdpa_context(torch.device("cpu")), contextlib.nullcontext)
