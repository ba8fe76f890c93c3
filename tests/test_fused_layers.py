"""The fused POET/OFT forward and backward against numerical Jacobians and the plain autograd composition, and what
they keep for the backward."""

import contextlib
import copy
import itertools

import pytest
import torch
from models import TinyCNN, tiny_llama
from peft import get_peft_model
from reference import (
    block_rotation_dense,
    cayley_inverse,
    householder_dense,
    neumann_series,
    skew_dense,
    subset_rotation_dense,
)
from tolerances import tiny_model_tolerance
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm

import poet_hf  # noqa: F401
from poet_hf import OftConfig, PoetConfig
from poet_hf.diagnostics import rotation_stats
from poet_hf.orthogonal import CayleyNeumann, HouseholderProduct, num_skew_params, orthogonal_from_vector
from poet_hf.orthogonal.base_ops import Conv2dOp
from poet_hf.orthogonal.norm_cap import MAX_SKEW_NORM
from poet_hf.orthogonal.rotated_linear import STRATEGIES, RotatedPass, SideRotation
from poet_hf.orthogonal.spo import SideSpec
from poet_hf.orthogonal.strategy_costs import auto_strategy, strategy_costs
from poet_hf.tuners.rotation.layer import rotation_layers
from poet_hf.tuners.rotation.model import plain_autograd

pytestmark = pytest.mark.numerics  # float64 / dense references at tolerances from the math


HOUSEHOLDER = "householder"  # in place of a term count: the Householder-product map


def make_side(kind: str, dim: int, block: int, terms: int | str, seed: int, shared: bool = False, keep=None):
    spec = SideSpec(kind, dim, block)
    index = spec.sample_index(torch.Generator().manual_seed(seed))
    rows = 1 if shared else spec.num_blocks
    generator = torch.Generator().manual_seed(seed + 1)
    if terms == HOUSEHOLDER:  # unit-scale vectors: reflections well away from v = 0, where H(v) is undefined
        orthogonal_map = HouseholderProduct(wy_block=2)  # two compact-WY products per block of 4
        vec = torch.randn(rows, orthogonal_map.num_params(block), dtype=torch.float64, generator=generator)
        return SideRotation(spec, index, orthogonal_map, keep), vec.requires_grad_()
    # ||Q||_2 ≈ 2·std·√b ≈ 0.4: well inside the Cayley–Neumann domain (MAX_SKEW_NORM), where the math is exact.
    vec = torch.randn(rows, num_skew_params(block), dtype=torch.float64, generator=generator) * (0.2 / block**0.5)
    return SideRotation(spec, index, CayleyNeumann(terms), keep), vec.requires_grad_()


def dense_block(side: SideRotation, row: torch.Tensor) -> torch.Tensor:
    """One block in float64 from the map's definition: an explicit inverse, powers, or reflection matrices."""
    b = side.spec.block
    if isinstance(side.orthogonal_map, HouseholderProduct):
        return householder_dense(row, b)
    terms = side.orthogonal_map.terms
    return cayley_inverse(skew_dense(row, b)) if terms == 0 else neumann_series(skew_dense(row, b), terms)


def dense_rotation(side: SideRotation, vec: torch.Tensor) -> torch.Tensor:
    """The side's d × d rotation in float64 from explicit loops, powers / inverses and selection matrices."""
    blocks = torch.stack([dense_block(side, row) for row in vec.detach()])
    if blocks.shape[0] != side.spec.num_blocks:
        blocks = blocks.expand(side.spec.num_blocks, -1, -1)
    if side.keep is not None:
        blocks = torch.where(side.keep[:, None, None], blocks, torch.eye(side.spec.block, dtype=torch.float64))
    if side.spec.kind == "full":
        return subset_rotation_dense(side.index, blocks[0], side.spec.dim)
    return block_rotation_dense(side.index if side.spec.kind == "block" else None, blocks)


CASES = list(
    itertools.product(["block", "contiguous", "full"], STRATEGIES, ["both", "input", "output"], [0, 5, HOUSEHOLDER])
)
# W0 stored in its block coordinates: every strategy, each side alone and both, a block side beside a full one.
STORED_CASES = list(
    itertools.product(STRATEGIES, [("block", "block"), ("block", None), (None, "block"), ("full", "block")])
)


def _case(kinds, terms, d_in=12, d_out=8):
    """Sides (``None`` where a kind is ``None``), an input, ``W0`` and a bias in float64."""
    blocks = {"full": (5, 3)}
    r_kind, p_kind = kinds
    r_side, r_vec = make_side(r_kind, d_in, blocks.get(r_kind, (4, 4))[0], terms, 1) if r_kind else (None, None)
    p_side, p_vec = make_side(p_kind, d_out, blocks.get(p_kind, (4, 4))[1], terms, 2) if p_kind else (None, None)
    x = torch.randn(2, 3, d_in, dtype=torch.float64, generator=torch.Generator().manual_seed(3)).requires_grad_()
    weight = torch.randn(d_out, d_in, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    bias = torch.randn(d_out, dtype=torch.float64, generator=torch.Generator().manual_seed(5)).requires_grad_()
    return (r_side, r_vec), (p_side, p_vec), x, weight, bias


def _check_against_dense(strategy, sides, x, weight, bias, stored=None):
    """The fused pass equals ``x R W0ᵀ P + b`` from dense float64 rotations, and passes gradcheck; ``stored`` is
    ``W0`` as the layer stores it (in block coordinates), ``weight`` the natural one the reference uses."""
    (r_side, r_vec), (p_side, p_vec) = sides
    rotated = RotatedPass(strategy, r_side, p_side, block_coordinates=stored is not None)
    given = weight if stored is None else stored
    y = rotated(x, given, bias, r_vec, p_vec)
    r = dense_rotation(r_side, r_vec) if r_side else torch.eye(weight.shape[1], dtype=torch.float64)
    p = dense_rotation(p_side, p_vec) if p_side else torch.eye(weight.shape[0], dtype=torch.float64)
    torch.testing.assert_close(y, x.detach() @ r @ weight.T @ p + bias.detach(), rtol=0, atol=1e-12)
    inputs = tuple(t for t in (x, bias, r_vec, p_vec) if t is not None)

    def f(*args):
        return rotated(args[0], given, args[1], args[2] if r_side else None, args[-1] if p_side else None)

    assert torch.autograd.gradcheck(f, inputs)


@pytest.mark.parametrize("kind,strategy,sides,terms", CASES)
def test_fused_function_matches_dense_reference_and_passes_gradcheck(kind, strategy, sides, terms):
    kinds = (kind if sides in ("both", "input") else None, kind if sides in ("both", "output") else None)
    r, p, x, weight, bias = _case(kinds, terms)
    _check_against_dense(strategy, (r, p), x, weight, bias)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_square_layer_whose_passes_reuse_their_buffers_matches_dense_reference(strategy):
    """In × in: each activation-sized result of a pass can take the memory of one that died (`Scratch`)."""
    r, p, x, weight, bias = _case(("block", "block"), 5, d_in=8, d_out=8)
    _check_against_dense(strategy, (r, p), x, weight, bias)


@pytest.mark.parametrize("strategy,kinds", STORED_CASES)
def test_a_w0_stored_in_block_coordinates_gives_the_natural_layers_function_and_gradients(strategy, kinds):
    """``Ψ_P · W0 · Ψ_Rᵀ`` (rows by the output permutation, columns by the input one; a full side's dimension as it
    is) with ``block_coordinates``: the layer of the natural ``W0``, against dense rotations."""
    r, p, x, weight, bias = _case(kinds, 5)
    stored = weight
    if p[0] is not None and p[0].spec.kind == "block":
        stored = stored[p[0].index]
    if r[0] is not None and r[0].spec.kind == "block":
        stored = stored[:, r[0].index]
    assert not torch.equal(stored, weight)
    _check_against_dense(strategy, (r, p), x, weight, bias, stored=stored)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_shared_and_dropped_blocks_have_exact_gradients(strategy):
    keep = torch.tensor([True, False, True])
    side, vec = make_side("contiguous", 12, 4, 5, 7, shared=True)
    side_masked, vec_masked = make_side("block", 12, 4, 5, 8, keep=keep)
    x = torch.randn(5, 12, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(6, 12, dtype=torch.float64)
    for s, v in ((side, vec), (side_masked, vec_masked)):
        y = RotatedPass(strategy, s)(x, weight, None, v)
        torch.testing.assert_close(y, x.detach() @ dense_rotation(s, v) @ weight.T, rtol=0, atol=1e-12)
        assert torch.autograd.gradcheck(lambda x_, v_, s=s: RotatedPass(strategy, s)(x_, weight, None, v_), (x, v))
    # A dropped block's parameters get no gradient.
    y = RotatedPass(strategy, side_masked)(x, weight, None, vec_masked)
    (grad,) = torch.autograd.grad(y.square().sum(), vec_masked)
    assert grad[1].abs().max() == 0 and grad[0].abs().max() > 0


@pytest.mark.parametrize("kind", ["block", "full"])
def test_conv2d_weight_strategy_matches_conv_with_dense_rotated_weight(kind):
    import torch.nn.functional as F

    conv = torch.nn.Conv2d(4, 6, 3, stride=2, padding=1).double()
    flat = conv.weight.detach().reshape(6, -1)  # 6 × 36
    r_side, r_vec = make_side(kind, 36, 12 if kind == "block" else 7, 5, 9)
    p_side, p_vec = make_side(kind, 6, 3 if kind == "block" else 4, 5, 10)
    op = Conv2dOp(tuple(conv.weight.shape), conv.stride, conv.padding, conv.dilation, conv.groups)
    x = torch.randn(2, 4, 7, 7, dtype=torch.float64, requires_grad=True)
    y = RotatedPass("weight", r_side, p_side, op)(x, flat, conv.bias, r_vec, p_vec)
    dense = dense_rotation(p_side, p_vec).T @ flat @ dense_rotation(r_side, r_vec).T
    torch.testing.assert_close(
        y, F.conv2d(x.detach(), dense.reshape(conv.weight.shape), conv.bias.detach(), 2, 1), rtol=0, atol=1e-12
    )
    assert torch.autograd.gradcheck(
        lambda x_, rv, pv: RotatedPass("weight", r_side, p_side, op)(x_, flat, conv.bias.detach(), rv, pv),
        (x, r_vec, p_vec),
    )


@pytest.mark.parametrize("terms", [0, 3, 5, 6, 8])
def test_fused_cayley_neumann_equals_the_series_of_eq_6_with_its_gradient(terms):
    """11 blocks: the vector-Jacobian product runs them in groups (`VJP_BLOCKS`, 8), checked by gradcheck."""
    vec = torch.randn(11, num_skew_params(6), dtype=torch.float64, requires_grad=True)
    fused = orthogonal_from_vector(vec * 0.1, 6, terms)  # ||Q||_2 ≈ 0.5: inside the series' domain
    reference = torch.stack(
        [
            cayley_inverse(q) if terms == 0 else neumann_series(q, terms)
            for q in (skew_dense(row, 6) for row in (vec * 0.1))
        ]
    )
    torch.testing.assert_close(fused, reference, rtol=0, atol=1e-13)
    assert torch.autograd.gradcheck(lambda v: orthogonal_from_vector(v * 0.1, 6, terms), (vec,))


# --- whole models: the fused path against the plain autograd path ---------------------------------------------------
CONFIGS = [
    PoetConfig(block_size=16, base_init="normalized"),
    PoetConfig(spo="full", budget=0.5, base_init="normalized", forward="activation"),
    PoetConfig(block_size=16, sides="output", forward="activation"),
    OftConfig(block_size=16, spo="block", merge_every=8),
]
CONFIG_IDS = ["poet-bs", "poet-fs-activation", "poet-output-activation", "oft-block"]


def _loss_and_gradients(model, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    logits = model(input_ids=batch).logits
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 128), batch[:, 1:].reshape(-1))
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def _relative_gap(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    """The largest ``max|got − expected| / max|expected|`` over the tensors (one scale per tensor)."""
    return max(float((got[k] - expected[k]).abs().max() / expected[k].abs().max().clamp_min(1e-300)) for k in expected)


def _step_by_step_gaps(config, dtype: torch.dtype, lr: float) -> tuple[float, float]:
    """Both paths start every step from the same state, the plain path's, so nothing compounds: the largest relative
    gap of one step's loss, gradients and (at steps 8 and 16) merged weights, and the largest ``||Q||_2`` reached."""
    models = {}
    for fused in (True, False):
        torch.manual_seed(0)
        models[fused] = get_peft_model(tiny_llama().to(dtype), copy.deepcopy(config)).train()
    plain, fused = models[False], models[True]
    optimizer = torch.optim.AdamW([p for p in plain.parameters() if p.requires_grad], lr=lr)
    data = torch.randint(0, 128, (4, 4, 16), generator=torch.Generator().manual_seed(0))
    gaps, largest_q = [], 0.0
    for step in range(20):
        fused.load_state_dict(plain.state_dict())
        fused.zero_grad(set_to_none=True)
        loss_fused, grads_fused = _loss_and_gradients(fused, data[step % 4])
        with plain_autograd(plain):
            loss_plain, grads_plain = _loss_and_gradients(plain, data[step % 4])
        gaps += [float((loss_fused - loss_plain).abs() / loss_plain), _relative_gap(grads_fused, grads_plain)]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        largest_q = max(largest_q, max(rotation_stats(layer)["q_norm"] for _, layer in rotation_layers(plain)))
        if (step + 1) % 8 == 0:
            fused.load_state_dict(plain.state_dict())
            # Each layer's own fold: a model's merge refuses a generator past the series' radius, which this run
            # reaches on purpose (fold_checks); the two paths' folds are compared here, not that policy.
            for model in (fused, plain):
                with plain_autograd(model) if model is plain else contextlib.nullcontext():
                    for _, layer in rotation_layers(model):
                        layer.merge_and_reinit("default")
            merged = {"fused": fused.state_dict(), "plain": plain.state_dict()}
            floats = {k for k, v in merged["plain"].items() if v.is_floating_point()}
            assert all(torch.equal(merged["fused"][k], v) for k, v in merged["plain"].items() if k not in floats)
            gaps.append(_relative_gap(*({k: merged[name][k] for k in floats} for name in ("fused", "plain"))))
            for p in [p for _, layer in rotation_layers(plain) for p in layer.rotation_parameters()]:
                optimizer.state.pop(p, None)
    return max(gaps), largest_q


# What rounding can do to one step (tiny_model_tolerance: 5.0e-4 in float32, 9.2e-13 in float64); a real difference
# between the paths (a missing term, a cap applied on one side only) is 1e-3 or larger.
@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
def test_every_step_of_a_float32_run_at_the_papers_learning_rate_matches_the_plain_autograd_path(config):
    gap, _ = _step_by_step_gaps(config, torch.float32, lr=1e-3)
    assert gap <= tiny_model_tolerance(torch.float32, backward=True), gap


def _rms_norm_in_input_dtype(self, hidden: torch.Tensor) -> torch.Tensor:
    """LLaMA's RMSNorm without its round trip through float32 (which caps any float64 comparison at float32
    rounding: a last-bit difference upstream flips a float32 rounding now and then, a 1e-8 relative jump)."""
    return self.weight * (hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
def test_in_float64_every_step_of_a_large_learning_rate_run_agrees_to_rounding(config, monkeypatch):
    monkeypatch.setattr(LlamaRMSNorm, "forward", _rms_norm_in_input_dtype)
    # At lr 5e-2 the Cayley–Neumann cap binds and merges fold large rotations: the regime where the paths could
    # differ. Run end to end, a 20-step trajectory at such a rate amplifies ulp-level differences up to 1e7-fold (Adam
    # divides by gradients near its eps: lr / eps = 5e6 per step), so its figure measures the machine's summation
    # order. Compared one step at a time from a shared state, nothing compounds.
    gap, largest_q = _step_by_step_gaps(config, torch.float64, lr=5e-2)
    assert largest_q > MAX_SKEW_NORM  # the run reached the capped regime it is meant to check
    assert gap <= tiny_model_tolerance(torch.float64, backward=True), gap


def _targets_trainable(adapter_model):
    """The base model with exactly the adapter's target Linears trainable (what full training of them keeps)."""
    plain = tiny_llama().train().requires_grad_(False)
    targets = {name.removeprefix("base_model.model.") for name, _ in rotation_layers(adapter_model)}
    for name, module in plain.named_modules():
        if name in targets:
            module.weight.requires_grad_(True)
    return plain


def _saved_bytes(model, ids) -> int:
    """Bytes of the distinct non-parameter tensors autograd keeps for the backward of one forward."""
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in parameters:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids).logits.sum()
    return sum(saved.values())


@pytest.mark.parametrize(
    "config",
    [
        PoetConfig(block_size=16),
        PoetConfig(spo="full"),
        OftConfig(block_size=16),
        PoetConfig(block_size=16, forward="weight"),
        OftConfig(block_size=16, forward="weight"),
    ],
    ids=["poet-auto", "poet-fs", "oft", "poet-weight", "oft-weight"],
)
def test_backward_keeps_no_more_than_training_the_targeted_weights_would_below_2048_wide(config):
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    model = get_peft_model(tiny_llama(), config).train()
    plain_bytes = _saved_bytes(_targets_trainable(model), ids)
    assert _saved_bytes(model, ids) == plain_bytes
    with plain_autograd(model):  # the reference path keeps rotated weights or activations: the check can fail
        assert _saved_bytes(model, ids) > plain_bytes


def test_activation_strategy_keeps_exactly_the_pre_rotation_outputs():
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    model = get_peft_model(tiny_llama(), PoetConfig(block_size=16, forward="activation")).train()
    plain_bytes = _saved_bytes(_targets_trainable(model), ids)
    outputs = sum(48 * layer.out_features * 4 for _, layer in rotation_layers(model))  # 48 tokens, float32
    assert _saved_bytes(model, ids) == plain_bytes + outputs


@pytest.mark.parametrize(
    "config",
    [PoetConfig(block_size=16, init_weights=False), OftConfig(block_size=16, init_weights=False)],
    ids=["poet", "oft"],
)
def test_bfloat16_autocast_runs_products_in_bfloat16_and_keeps_float32_gradients(config):
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(3))
    model = get_peft_model(tiny_llama(), config)
    reference = model(input_ids=ids).logits.detach()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(input_ids=ids).logits
    assert logits.dtype in (torch.bfloat16, torch.float32)  # the model upcasts its logits itself
    # bfloat16 keeps 8 significant bits: ~0.4% per rounding, a few roundings deep per layer.
    assert (logits.float() - reference).abs().max() <= 0.05 * reference.abs().max()
    assert (logits.float() - reference).abs().max() > 0  # the products really ran in bfloat16
    logits.float().square().mean().backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads)


# --- the cost model ---------------------------------------------------------------------------------------------------
def test_counts_match_by_hand_and_auto_keeps_h_only_where_it_saves_a_tenth_within_half_of_w0():
    block = SideSpec("block", 768, 256)
    costs = strategy_costs(1024, 768, 768, block, block, training=True)
    n, rotation_w, rotation_t = 768 * 768, 768 * 768 * 256, 1024 * 768 * 256
    assert costs["weight"] == {"macs": 3 * 1024 * n + 7 * rotation_w, "kept": 0.0}
    assert costs["activation"] == {"macs": 2 * 1024 * n + 6 * rotation_t, "kept": 1024 * 768}
    assert costs["activation-recompute"]["macs"] == 3 * 1024 * n + 7 * rotation_t
    # By hand at b = 256, 2048 tokens (in units of T·N): at 4096² activation 2 + 6·256/4096 = 2.375, the weight
    # strategy 3 + 7·256/2048 = 3.875 and recompute 3 + 7·256/4096 = 3.4375, so keeping h saves 31 % and h (T·d_out)
    # is half of W0, the most allowed. At 8192 tokens h would be twice W0: not kept, and the weight strategy
    # (3 + 7·256/8192 = 3.22) beats recompute (3.4375). At 1024² and 512 tokens activation (3.5) saves 26 % on
    # recompute (4.75), but the layer is narrower than 2048: nothing is kept.
    wide, narrow = SideSpec("block", 4096, 256), SideSpec("block", 1024, 256)
    assert auto_strategy(strategy_costs(2048, 4096, 4096, wide, wide, True), 4096, 4096) == "activation"
    assert auto_strategy(strategy_costs(8192, 4096, 4096, wide, wide, True), 4096, 4096) == "weight"
    assert auto_strategy(strategy_costs(512, 1024, 1024, narrow, narrow, True), 1024, 1024) == "activation-recompute"
    square = rotation_layers(get_peft_model(nn.Sequential(nn.Linear(2048, 2048)), PoetConfig(target_modules=["0"])))
    layer = square[0][1]  # b = 256 (the default), polynomial counted as an uncached call pays it
    assert layer.choose_strategy("default", tokens=1024, training=True) == "activation"  # h: exactly half of W0
    assert layer.choose_strategy("default", tokens=1025, training=True) != "activation"  # one row more
    tiny = rotation_layers(get_peft_model(tiny_llama(), PoetConfig(block_size=16)))[0][1]  # 64 wide
    assert tiny.choose_strategy("default", tokens=4096, training=True) == "weight"
    assert tiny.choose_strategy("default", tokens=4, training=True) == "activation-recompute"
    oft = rotation_layers(get_peft_model(tiny_llama(), OftConfig(block_size=16)))[0][1]
    assert oft.choose_strategy("default", tokens=4096, training=True) == "activation"  # one side: keeps nothing


def test_conv2d_model_trains_through_the_fused_weight_strategy():
    model = get_peft_model(
        TinyCNN(), PoetConfig(block_size=4, target_modules=["conv1", "conv2", "head"], init_weights=False)
    )
    images = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(4))
    fused = model(images)
    fused.square().mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad()
    with plain_autograd(model):
        plain = model(images)
        plain.square().mean().backward()
    torch.testing.assert_close(fused, plain, rtol=0, atol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, dict(model.named_parameters())[name].grad, rtol=1e-5, atol=1e-7)
