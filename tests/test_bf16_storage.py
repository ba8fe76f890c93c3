"""The head and input embeddings stored in bfloat16 and stepped with stochastic rounding (``vocab_weights_dtype``).

References: the two bfloat16 neighbours of a value and the float64 AdamW step, worked out here; float64 products and
sums with float32's rounding bound ``γ_n = n·u/(1 − n·u)``, ``u = 2⁻²⁴``, and bfloat16's rounding to nearest, a
relative ``2⁻⁸`` (8 significant bits); the mean of many rounded values against the exact one, within six standard
deviations of the binomial count."""

from __future__ import annotations

import copy
import math

import bitsandbytes
import pytest
import torch
from models import llama_config, tiny_llama
from peft import get_peft_model

from poet_hf import PoetConfig, PoetTrainingArguments
from poet_hf.recipes.memory_plan import plan_memory
from poet_hf.training import FusedStepOptimizer, create_poet_optimizer, poet_param_groups
from poet_hf.training.bf16_storage import BFloat16Step, UpcastEmbedding, UpcastLinear, stochastic_round

U = 2.0**-24


def gamma(n: int) -> float:
    return n * U / (1 - n * U)


def bf16_neighbours(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bfloat16 numbers either side of each float64 ``x`` (toward zero, away from zero): 8 significant bits."""
    exponent = torch.floor(torch.log2(x.abs()))
    gap = torch.pow(2.0, exponent - 7)
    toward = torch.sign(x) * torch.floor(x.abs() / gap) * gap
    return toward, toward + torch.sign(x) * gap


@pytest.mark.numerics
def test_stochastic_rounding_lands_on_a_neighbour_and_is_unbiased():
    torch.manual_seed(0)
    x = (torch.randn(64) * torch.logspace(-20, 20, 64, base=2.0)).float()
    x[:4] = torch.tensor([1.0, -0.5, 1.0 + 2**-9, -(3.0 + 2**-8)])  # two exact values, two ties
    toward, away = bf16_neighbours(x.double())
    draws = torch.stack([stochastic_round(x) for _ in range(4096)]).double()
    assert ((draws == toward) | (draws == away)).all()
    assert torch.equal(draws[:, :2], x[:2].double().expand(4096, 2))  # a bfloat16 value is kept
    share_up = (x.double() - toward) / (away - toward)  # the probability of rounding away from zero
    sigma = (away - toward).abs() * torch.sqrt(share_up * (1 - share_up) / 4096)
    assert ((draws.mean(0) - x.double()).abs() <= 6 * sigma + 1e-300).all()
    assert (draws[:, 2:4] == away[2:4]).any(0).all() and (draws[:, 2:4] == toward[2:4]).any(0).all()


@pytest.mark.numerics
def test_the_upcast_linear_and_embedding_give_float32_products_and_round_the_gradient_once():
    torch.manual_seed(1)
    x = torch.randn(3, 5, 8, requires_grad=True)
    weight = torch.randn(6, 8).bfloat16().requires_grad_(True)
    out = UpcastLinear.apply(x, weight)
    reference = x.double() @ weight.double().T
    assert (out.double() - reference).abs().le(gamma(8) * (x.double().abs() @ weight.double().abs().T)).all()
    upstream = torch.randn(3, 5, 6)
    out.backward(upstream)
    c, xs = upstream.reshape(-1, 6).double(), x.detach().reshape(-1, 8).double()
    exact, bound = c.T @ xs, gamma(15) * (c.abs().T @ xs.abs())
    assert weight.grad.dtype == torch.bfloat16
    assert (weight.grad.double() - exact).abs().le(2.0**-8 * (exact.abs() + bound) + bound).all()
    exact_x = upstream.double() @ weight.detach().double()
    assert (x.grad.double() - exact_x).abs().le(gamma(6) * (upstream.double().abs() @ weight.double().abs())).all()

    table = torch.randn(10, 4).bfloat16().requires_grad_(True)
    ids = torch.tensor([[1, 3, 3, 0], [3, 9, 1, 0]])
    rows = UpcastEmbedding.apply(ids, table, 0)
    assert rows.dtype == torch.float32 and torch.equal(rows.double(), table.detach().double()[ids])
    upstream = torch.randn(2, 4, 4)
    rows.backward(upstream)
    exact = torch.zeros(10, 4, dtype=torch.float64).index_add_(0, ids.reshape(-1), upstream.reshape(-1, 4).double())
    exact[0] = 0  # padding_idx
    bound = gamma(3) * torch.zeros(10, 4, dtype=torch.float64).index_add_(
        0, ids.reshape(-1), upstream.reshape(-1, 4).double().abs()
    )
    assert (table.grad.double() - exact).abs().le(2.0**-8 * (exact.abs() + bound) + bound).all()
    assert not table.grad[0].any()


def adamw_step64(p, g, lr, betas, eps, decay):
    """One first step of AdamW in float64 (bias-corrected moments of a single gradient)."""
    m, v = (1 - betas[0]) * g, (1 - betas[1]) * g * g
    update = (m / (1 - betas[0])) / ((v / (1 - betas[1])).sqrt() + eps)
    return p * (1 - lr * decay) - lr * update, m, v


@pytest.mark.numerics
def test_a_bfloat16_step_is_adamw_in_float64_to_within_one_bfloat16_spacing():
    torch.manual_seed(2)
    param = torch.nn.Parameter(torch.randn(32, 16).bfloat16())
    param.grad = torch.randn(32, 16).bfloat16()
    p64, g64 = param.detach().double(), param.grad.double()
    step = BFloat16Step(param, torch.optim.AdamW, lr=3e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    step.step()
    expected_p, expected_m, expected_v = adamw_step64(p64, g64, 3e-2, (0.9, 0.95), 1e-8, 0.1)
    state = step.state[param]
    assert set(step.state) == {param} and param.dtype == state["exp_avg"].dtype == torch.bfloat16
    for got, want in ((param, expected_p), (state["exp_avg"], expected_m), (state["exp_avg_sq"], expected_v)):
        toward, away = bf16_neighbours(want)
        slack = 8 * U * want.abs()  # the float32 arithmetic before the rounding
        low, high = torch.minimum(toward, away) - slack, torch.maximum(toward, away) + slack
        assert ((got.double() >= low) & (got.double() <= high)).all()


@pytest.mark.numerics
def test_updates_far_below_a_bfloat16_spacing_still_move_the_weights_by_their_size_on_average():
    """Rounding to nearest would keep every weight at 1.0 (the update 1e-4 is 0.026 of the spacing 2⁻⁸ below 1)."""
    torch.manual_seed(3)
    param = torch.nn.Parameter(torch.ones(256, 256, dtype=torch.bfloat16))
    param.grad = torch.ones_like(param)
    BFloat16Step(param, torch.optim.AdamW, lr=1e-4, weight_decay=0.0).step()
    expected = 1 - 1e-4 / (1 + 1e-8)
    share = 1e-4 / 2**-8
    sigma = 2**-8 * math.sqrt(share * (1 - share) / param.numel())
    assert abs(param.double().mean().item() - expected) <= 6 * sigma
    assert set(param.unique().tolist()) == {1.0, 1 - 2**-8}


def vocab_model() -> torch.nn.Module:
    """A POET LLaMA whose embeddings (64 × 256) and head train in full; 256 wide, so the head keeps 8-bit states."""
    model = get_peft_model(tiny_llama(hidden=256, intermediate=256, vocab=64), PoetConfig(block_size=64))
    for name, parameter in model.named_parameters():
        if "embed_tokens" in name or "lm_head" in name:
            parameter.requires_grad_(True)
    return model


BATCHES = [torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))] * 4  # one batch, learnt


def steps(model, optimizer, batches) -> list[float]:
    losses = []
    for ids in batches:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_vocabulary_weights_train_with_8bit_and_32bit_states_and_resume_bit_for_bit(tmp_path, dtype):
    """bitsandbytes' 8-bit AdamW with fused steps: the embeddings keep 32-bit moments (bfloat16 ones when stored in
    bfloat16), the head 8-bit codes and float32 scales, also after a resume (torch's loader would cast the codes to
    the parameter's dtype), which continues bit for bit."""
    args = PoetTrainingArguments(
        output_dir=str(tmp_path), optim="adamw_bnb_8bit", learning_rate=1e-2, fused_optimizer_step=True,
        vocab_weights_dtype=dtype, report_to="none", use_cpu=True,
    )  # fmt: skip
    model, twin = vocab_model(), vocab_model()
    optimizer = create_poet_optimizer(model, args)
    inner, stored = model.base_model.model, getattr(torch, dtype)
    assert inner.model.embed_tokens.weight.dtype == inner.lm_head.weight.dtype == stored
    first = steps(model, optimizer, BATCHES[:2])
    embedding, head = inner.model.embed_tokens.weight, inner.lm_head.weight

    def state_of(opt, weight) -> dict:
        chunks = {id(c.weight): c.chunks[0] for c in opt.row_gradients.chunked} if opt.row_gradients else {}
        return opt.state[next((c for c in chunks.values() if c.data_ptr() == weight.data_ptr()), weight)]

    assert state_of(optimizer, embedding)["state1"].dtype == stored  # 32-bit moments, in the weight's storage
    assert state_of(optimizer, head)["state1"].dtype == torch.uint8
    saved_model, saved = copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict())
    rng = torch.get_rng_state()
    later = steps(model, optimizer, BATCHES[2:])
    assert later[-1] < first[0]

    twin_optimizer = create_poet_optimizer(twin, args)
    twin.load_state_dict(saved_model)
    twin_optimizer.load_state_dict(saved)
    twin_head = state_of(twin_optimizer, twin.base_model.model.lm_head.weight)
    assert twin_head["state1"].dtype == torch.uint8 and twin_head["absmax1"].dtype == torch.float32
    torch.set_rng_state(rng)
    assert steps(twin, twin_optimizer, BATCHES[2:]) == later
    for (name, a), b in zip(model.state_dict().items(), twin.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_the_plan_counts_two_bytes_per_vocabulary_entry_and_per_32bit_moment():
    """Embeddings and head of 512 × 256 each: 2 B saved per entry of each weight, and 4 B per entry of the
    embeddings' two 32-bit moments; the head's 8-bit moments are unchanged."""
    config = llama_config(hidden=256, intermediate=512, vocab=512)
    common = {"fused_step": True, "optimizer_bits": 8, "batch_size": 1, "seq_len": 32, "block_size": 64}
    wide = plan_memory(config, **common).parts
    narrow = plan_memory(config, vocab_weights_dtype="bfloat16", **common).parts
    entries = 512 * 256
    assert wide["trainable parameters"] - narrow["trainable parameters"] == 2 * 2 * entries
    assert wide["optimizer states"] - narrow["optimizer states"] == 4 * entries
    assert narrow["bfloat16 steps"] == 6 * 4 * entries  # float32 copies of one chunk (here the whole weight)


def test_bfloat16_vocabulary_weights_are_refused_where_they_cannot_run(tmp_path):
    with pytest.raises(ValueError, match="set fused_optimizer_step=True too"):
        PoetTrainingArguments(output_dir=str(tmp_path), vocab_weights_dtype="bfloat16")
    with pytest.raises(ValueError, match="must be one of float32, bfloat16"):
        PoetTrainingArguments(output_dir=str(tmp_path), vocab_weights_dtype="float16", fused_optimizer_step=True)
    tied = get_peft_model(tiny_llama(tie_word_embeddings=True), PoetConfig(block_size=16))
    groups = poet_param_groups(tied, 1e-3, 1e-3, 0.0, [])
    with pytest.raises(ValueError, match="a head tied to its embeddings stays float32"):
        FusedStepOptimizer(groups, torch.optim.AdamW, model=tied, vocab_weights_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="an optimizer that updates entry by entry"):
        FusedStepOptimizer(groups, bitsandbytes.optim.LAMB, model=tied, vocab_weights_dtype=torch.bfloat16)
