"""engine.kernels.cpu.moe_experts: the one-call bf16 MoE step against its plain torch reference (expert by
expert, bf16 torch ops, index_add_ in ascending expert order), for all experts held and for an
expert-parallel rank's block, with float32 (Mixtral) and bf16 (Qwen3-MoE) routing weights, the kernel's own
dot products and experts handed to the `expert` callback (many rows)."""
import pytest
import torch

from engine.kernels.cpu.moe_experts import moe_experts_bf16, moe_experts_reference


def _case(tokens: int, top_k: int, experts: int = 8, hidden: int = 64, inter: int = 32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=g) * 0.2).to(torch.bfloat16)
    down = (torch.randn(experts, hidden, inter, generator=g) * 0.2).to(torch.bfloat16)
    probs = torch.softmax(torch.randn(tokens, experts, generator=g), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    return h, ids, weights, gate_up, down


@pytest.mark.parametrize("tokens,top_k", [(1, 2), (3, 2), (16, 2), (16, 8), (37, 4)])
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("max_work", [0, 2 ** 21])  # every expert by the callback; every one in the kernel
def test_kernel_equals_the_torch_reference(tokens, top_k, weight_dtype, max_work):
    h, ids, weights, gate_up, down = _case(tokens, top_k, seed=tokens * 10 + top_k)
    weights = weights.to(weight_dtype)
    ref = moe_experts_reference(h, ids, weights, 0, gate_up, down)
    got = moe_experts_bf16(h, ids, weights, 0, gate_up, down, max_work=max_work)
    if max_work == 0:  # the callback's rows with the reference's ops: the combine must be bit for bit
        assert torch.equal(got, ref)
    else:  # the kernel's float32 sums in another order: a last bf16 bit now and then
        torch.testing.assert_close(got, ref, atol=float(ref.abs().max()) / 128, rtol=0)
    assert got.abs().max() > 0


@pytest.mark.parametrize("first", [0, 4])
def test_an_expert_rank_computes_only_its_block(first):
    h, ids, weights, gate_up, down = _case(16, 2, seed=3)
    whole = moe_experts_reference(h, ids, weights, 0, gate_up, down)
    part = moe_experts_bf16(h, ids, weights, first, gate_up[first:first + 4], down[first:first + 4])
    torch.testing.assert_close(part, moe_experts_reference(h, ids, weights, first, gate_up[first:first + 4],
                                                           down[first:first + 4]), atol=float(whole.abs().max()) / 128, rtol=0)
    untouched = ~((ids >= first) & (ids < first + 4)).any(dim=1)  # tokens none of the block's experts took
    assert torch.equal(part[untouched], torch.zeros_like(part[untouched]))


def test_the_callback_gets_local_ids_and_many_rows():
    h, ids, weights, gate_up, down = _case(64, 8, seed=1)
    seen = []

    def expert(e, x):
        seen.append((e, x.shape[0]))
        gate, up = torch.nn.functional.linear(x, gate_up[e]).chunk(2, dim=-1)
        return torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, down[e])
    got = moe_experts_bf16(h, ids, weights, 0, gate_up, down, expert, max_work=0)
    assert sorted(seen) == [(e, 64) for e in range(8)]  # top-8 of 8: every token at every expert
    assert torch.equal(got, moe_experts_reference(h, ids, weights, 0, gate_up, down))
