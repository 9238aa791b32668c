"""The Triton grouped MoE kernel (engine/kernels/cuda/moe_grouped.py) against its torch references
(`engine.moe.grouped`, `per_token`), on CPU under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1
without CUDA): float32 and bf16, top-1/2/8, 4-16 experts, 1-17 tokens, widths that are not powers of two,
expert-parallel halves, experts no token chose, padded row blocks; the device-side grouping (`align`) on its own;
no host sync in the launcher; where `moe_choice` sends each device; a tiny Qwen3-MoE engine through the static
decode step CUDA graphs capture (eagerly here) with the kernel: grouped's float32 greedy tokens, no host sync in
the step."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from engine import LLM, SamplingParams, moe  # noqa: E402
from engine.config import MoEConfig  # noqa: E402
from engine.kernels.cuda.moe_grouped import _config, align, max_blocks, moe_grouped  # noqa: E402
from engine.linear import Linear  # noqa: E402
from tests.conftest import assert_engine_empty  # noqa: E402
from tests.exactness import assert_greedy_equal  # noqa: E402
from tests.tiny_moe_models import write_tiny_moe  # noqa: E402

SYNCS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "nonzero")


def _layer(experts, top_k, hidden=64, inter=32, dtype=torch.float32, first=0, held=None, seed=0):
    """An MoE layer of random experts; (first, held): an expert-parallel rank's block of them."""
    g = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=g) * 0.2).to(dtype)
    down = (torch.randn(experts, hidden, inter, generator=g) * 0.2).to(dtype)
    router = (torch.randn(experts, hidden, generator=g) * 0.5).to(dtype)
    held = experts if held is None else held
    gate_up, down = gate_up[first:first + held].contiguous(), down[first:first + held].contiguous()
    cfg = MoEConfig(experts, top_k, inter, True, (0,), False, "qwen")
    return moe.MoELayer(cfg, router, gate_up, down, [Linear(t) for t in gate_up], [Linear(t) for t in down], first)


def _routing(tokens, experts, top_k, hidden=64, dtype=torch.float32, seed=1, allowed=None):
    """h [tokens, hidden] and its top-k (weights float32, ids); `allowed`: the only experts any token picks."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=g).to(dtype)
    logits = torch.randn(tokens, experts, generator=g)
    if allowed is not None:
        logits[:, [e for e in range(experts) if e not in allowed]] = float("-inf")
    weights, ids = torch.topk(torch.softmax(logits, -1), top_k)
    return h, weights / weights.sum(-1, keepdim=True), ids


def _run(layer, h, weights, ids):
    return moe_grouped(h, ids, weights, layer.gate_up, layer.down, layer.first_expert)


CASES = [  # tokens, experts, top-k, first expert held, experts held (None: all), hidden, inter
    (1, 8, 1, 0, None, 64, 32),  # decode, top-1
    (3, 8, 2, 0, None, 64, 32),
    (17, 16, 8, 0, None, 64, 32),  # top-8, about 8 rows an expert: every block padded
    (17, 4, 4, 0, None, 64, 32),  # 17 rows an expert: 32-row blocks, 15 rows of each padding
    (17, 8, 8, 0, None, 48, 24),  # every token at every expert; widths not powers of two (masked tiles)
    (3, 8, 2, 4, 4, 64, 32),  # an expert-parallel rank holding the upper half
    (17, 16, 8, 8, 8, 64, 32),
    (17, 16, 2, 0, 8, 64, 32),  # the lower half
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"t{c[0]}e{c[1]}k{c[2]}from{c[3]}h{c[5]}")
def test_kernel_matches_grouped(case, dtype):
    tokens, experts, top_k, first, held, hidden, inter = case
    layer = _layer(experts, top_k, hidden, inter, dtype, first, held, seed=tokens + experts)
    h, weights, ids = _routing(tokens, experts, top_k, hidden, dtype, seed=top_k)
    if dtype == torch.bfloat16:  # Qwen3-MoE's routing weights are in the model dtype, Mixtral's float32
        weights = weights.to(dtype) if tokens % 2 else weights
    got = _run(layer, h, weights, ids)
    want = moe.grouped(layer, h, weights, ids)
    assert got.dtype == dtype and got.shape == h.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    else:  # the same roundings (linear outputs, silu, weighting, each add); float32 sums in another order
        torch.testing.assert_close(got, want, atol=float(want.abs().max()) / 128, rtol=0)
    untouched = ~((ids >= first) & (ids < first + (held or experts))).any(dim=1)  # tokens this rank adds nothing to
    assert torch.equal(got[untouched], torch.zeros_like(got[untouched]))
    assert got.abs().max() > 0


def test_moe_forward_through_the_triton_choice_equals_per_token():
    """The layer's own router, through `moe_forward(..., "triton")`: the per-token reference's float32 sums."""
    layer = _layer(8, 2, seed=3)
    h = torch.randn(17, 64, generator=torch.Generator().manual_seed(4))
    want = moe.moe_forward(layer, h, "per_token")
    torch.testing.assert_close(moe.moe_forward(layer, h, "triton"), want, atol=1e-5, rtol=1e-5)


def test_experts_no_token_chose_and_a_rank_none_chose():
    """Tokens pick only experts 1, 2 and 5 of 16: the other experts' blocks stay unused; the rank holding
    8..15 returns zeros; the two halves' partial sums add up to the whole."""
    h, weights, ids = _routing(17, 16, 2, allowed={1, 2, 5})
    whole = _layer(16, 2, seed=9)
    low, high = _layer(16, 2, seed=9, held=8), _layer(16, 2, seed=9, first=8, held=8)
    got = _run(whole, h, weights, ids)
    torch.testing.assert_close(got, moe.grouped(whole, h, weights, ids), atol=1e-5, rtol=1e-5)
    assert torch.equal(_run(high, h, weights, ids), torch.zeros_like(h))
    torch.testing.assert_close(_run(low, h, weights, ids) + _run(high, h, weights, ids), got, atol=1e-5, rtol=1e-5)


def test_strided_rows_are_read_in_place():
    """Weights and h as views with padded rows (a TP rank's slice of down is one): the dense copies' answer."""
    layer = _layer(8, 2, seed=6)
    h, weights, ids = _routing(5, 8, 2)
    want = _run(layer, h, weights, ids)

    def padded(x):  # the same values, each row 8 elements longer in memory
        return torch.cat([x, torch.zeros(*x.shape[:-1], 8)], -1)[..., :x.shape[-1]]
    got = moe_grouped(padded(h), ids, weights, padded(layer.gate_up), padded(layer.down), 0)
    assert padded(layer.down).stride(1) == layer.down.shape[2] + 8
    assert torch.equal(got, want)


def test_the_kernel_can_fail():
    """Another expert's weights must change the answer (the comparisons above are not vacuous)."""
    layer = _layer(8, 2, seed=5)
    h, weights, ids = _routing(3, 8, 2)
    want = moe.grouped(layer, h, weights, ids)
    got = moe_grouped(h, ids, weights, layer.gate_up.roll(1, 0), layer.down, 0)
    assert not torch.allclose(got, want, atol=1e-3)
    got = moe_grouped(h, ids, weights, layer.gate_up, layer.down, 1)  # ids read as one expert off
    assert not torch.allclose(got, want, atol=1e-3)


@pytest.mark.parametrize("tokens,top_k,experts,first,block_m", [(1, 8, 128, 0, 16), (17, 2, 8, 4, 16),
                                                                  (17, 8, 4, 0, 32), (5, 2, 16, 8, 16)])
def test_align_pads_each_expert_to_whole_blocks(tokens, top_k, experts, first, block_m):
    """Every held assignment in exactly one padded row, each block one expert's (ascending), tokens ascending
    within an expert, padding marked n, unused blocks marked `experts`, other ranks' assignments absent."""
    g = torch.Generator().manual_seed(tokens)
    ids = torch.stack([torch.randperm(first + experts + 4, generator=g)[:top_k] for _ in range(tokens)])
    n = ids.numel()
    rows, block_expert = align(ids, first, experts, block_m)
    blocks = max_blocks(n, experts, block_m)
    assert rows.shape == (blocks * block_m,) and block_expert.shape == (blocks,)
    flat = ids.reshape(-1) - first
    held = [i for i in range(n) if 0 <= flat[i] < experts]
    by_row = rows.tolist()
    assert sorted(r for r in by_row if r < n) == held and all(r <= n for r in by_row)
    blocks = block_expert.tolist()
    used = [b for b in blocks if b < experts]
    assert used == sorted(used) and all(b == experts for b in blocks[len(used):])
    for b, e in enumerate(blocks):
        mine = [r for r in by_row[b * block_m:(b + 1) * block_m] if r < n]
        assert all(flat[r] == e for r in mine) and mine == sorted(mine)
        assert (e == experts) == (not mine) and (not mine or by_row[b * block_m] < n)  # a block's rows come first


def _spy_syncs(m) -> list[str]:
    """Patches the tensor methods that copy device values to the host; returns the list each call lands in."""
    calls = []
    for name in SYNCS:
        def spy(t, *a, _name=name, _real=getattr(torch.Tensor, name), **kw):
            calls.append(_name)
            return _real(t, *a, **kw)
        m.setattr(torch.Tensor, name, spy)
    return calls


def test_the_launcher_has_no_host_sync(monkeypatch):
    """Nothing read back to the host (what a CUDA graph could not capture); the spy sees grouped's .tolist()."""
    layer = _layer(16, 8, seed=2, first=8, held=8)
    h, weights, ids = _routing(17, 16, 8)
    with monkeypatch.context() as m:
        calls = _spy_syncs(m)
        got = _run(layer, h, weights, ids)
        assert calls == [], f"host syncs in moe_grouped: {calls}"
        want = moe.grouped(layer, h, weights, ids)
    assert "tolist" in calls  # the detector can fail
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_configs_are_fixed_by_shape():
    assert _config(8, 128, 2048, 768)[0] == 16  # Qwen3-30B-A3B at batch 1: 16-row blocks
    assert _config(128 * 8, 128, 2048, 768)[0] == 16
    assert _config(4096 * 8, 128, 2048, 768)[0] == 64  # prefill: 256 rows an expert
    assert _config(17, 8, 48, 24)[1:3] == (32, 32)  # tiles no wider than the matrices need
    assert max_blocks(8, 128, 16) == 8  # decode at top-8: one block per chosen expert, not one per expert


def test_moe_choice(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.delenv("PDSERVE_MOE", raising=False)
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    assert moe.moe_choice(cpu) == "grouped"
    # CUDA keeps the torch paths by default until a GPU run has measured the kernel (asked for by name meanwhile)
    assert moe.moe_choice(cuda) == "grouped"
    capturing[0] = True
    assert moe.moe_choice(cuda) == "dense"
    capturing[0] = False
    monkeypatch.setenv("PDSERVE_MOE", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert moe.moe_choice(cpu) == "triton"  # under the interpreter: these tests
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="PDSERVE_MOE=triton"):
        moe.moe_choice(cpu)
    assert moe.moe_choice(cuda) == "triton"


def test_engine_static_decode_step_with_the_kernel(tmp_path, monkeypatch):
    """A tiny Qwen3-MoE (8 experts, top-3) through the Triton paged attention and the static decode step,
    its MoE layers through the kernel: the float32 greedy tokens of the same engine with `grouped`; the step a
    CUDA graph captures reads nothing back to the host (before this kernel, `grouped` there would)."""
    model = write_tiny_moe("qwen3_moe", tmp_path / "m")
    prompts, params = [[10, 11, 12], list(range(20, 33))], SamplingParams(max_tokens=3, temperature=0.0,
                                                                          ignore_eos=True)
    kw = dict(dtype="float32", num_pages=64, max_num_batched_tokens=64, max_num_seqs=2, max_model_len=128)
    monkeypatch.setenv("PDSERVE_ATTENTION", "torch")
    monkeypatch.setenv("PDSERVE_MOE", "grouped")
    ref = LLM(model=str(model), keep_logits=True, **kw).generate(prompts, params)
    monkeypatch.setenv("PDSERVE_ATTENTION", "triton")
    monkeypatch.setenv("PDSERVE_MOE", "triton")
    llm = LLM(model=str(model), decode_graphs="static", **kw)
    assert llm.decode_graphs is not None
    got = llm.generate(prompts, params)
    assert_greedy_equal([o.token_ids for o in ref], [o.token_ids for o in got], [torch.stack(o.logits) for o in ref])
    llm.add_request(prompts[0], params)
    llm.step()  # the prompt
    with monkeypatch.context() as m:
        calls = _spy_syncs(m)
        llm.decode_graphs._forward(llm.decode_graphs.buckets[1, 1])  # what a CUDA graph would capture
    assert calls == [], f"host syncs inside the static step: {calls}"
    llm.generate_until_idle()
    assert_engine_empty(llm)
