"""The OFT tuner against PEFT's own OFT, dense float64 references, F.conv2d and the
hyperspherical energy computed here."""

import copy
import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from models import tiny_gpt2, tiny_llama
from peft import OFTConfig, PeftModel, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from reference import block_rotation_dense, cayley_inverse, neumann_series, skew_dense
from safetensors.torch import load_file
from tolerances import gamma, unit_roundoff
from torch import nn

import poet_hf  # noqa: F401  (registers the tuners)
from poet_hf.orthogonal.norm_cap import MAX_SKEW_NORM
from poet_hf.tuners.oft import OftConfig, OftLayer, our_oft_state_dict_to_peft, peft_oft_state_dict_to_ours
from poet_hf.tuners.poet import merge_and_reinit

pytestmark = pytest.mark.numerics  # float64 / dense references at tolerances from the math

IDS = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))


class OneLinear(nn.Module):
    def __init__(self, d_in: int = 64, d_out: int = 48) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(d_in, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


class OneConv(nn.Module):
    def __init__(self, kernel: int, stride: int, padding: int, dilation: int = 1) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(4, 6, kernel, stride=stride, padding=padding, dilation=dilation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)


def oft_layers(model):
    return [(n, m) for n, m in model.named_modules() if isinstance(m, OftLayer)]


@torch.no_grad()
def set_random_skew(model, std: float, seed: int = 3) -> None:
    generator = torch.Generator().manual_seed(seed)
    for _, layer in oft_layers(model):
        for param in layer.poet_oft_R.values():
            param.copy_(torch.randn(param.shape, generator=generator) * std)


def dense_rotation(layer, adapter="default") -> torch.Tensor:
    """R (in × in, float64) from the layer's raw parameters, by loops and explicit powers / inverses."""
    param = layer.poet_oft_R[adapter].detach().double()
    spec = layer.rotation_specs[adapter]["input"]
    terms = layer.rotation_settings[adapter].orthogonal_map.terms
    qs = [skew_dense(row, spec.block) for row in param]
    blocks = torch.stack([cayley_inverse(q) if terms == 0 else neumann_series(q, terms) for q in qs])
    if blocks.shape[0] == 1:
        blocks = blocks.expand(spec.num_blocks, -1, -1)
    index = layer.poet_oft_R_index[adapter]
    return block_rotation_dense(index if index.numel() else None, blocks)


# --- 1. conformance with PEFT's OFTConfig -----------------------------------------------------------------------------
@pytest.mark.parametrize("peft_terms,exact", [(5, False), (4, False), (3, False), (7, False), (5, True)])
@pytest.mark.parametrize("block_share", [False, True])
@pytest.mark.parametrize("forward", ["activation", "weight"])
def test_linear_matches_peft_oft_outputs_and_gradients(peft_terms, exact, block_share, forward):
    x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(4))
    peft_config = OFTConfig(
        oft_block_size=16,
        target_modules=["lin"],
        use_cayley_neumann=not exact,
        num_cayley_neumann_terms=peft_terms,
        block_share=block_share,
    )
    theirs = get_peft_model(OneLinear(), peft_config)
    with torch.no_grad():
        param = theirs.base_model.model.lin.oft_R["default"].weight
        param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(5)) * 0.05)
    ours = get_peft_model(OneLinear(), OftConfig.from_peft_config(peft_config, forward=forward))
    result = set_peft_model_state_dict(ours, peft_oft_state_dict_to_ours(get_peft_model_state_dict(theirs), exact))
    assert not result.unexpected_keys and not [k for k in result.missing_keys if "poet_oft" in k]

    y_theirs, y_ours = theirs(x), ours(x)
    assert (y_theirs - y_ours).abs().max() <= 1e-6
    assert (y_theirs - theirs.get_base_model().lin.base_layer(x)).abs().max() > 1e-2  # a real rotation
    y_theirs.square().sum().backward()
    y_ours.square().sum().backward()
    g_theirs = theirs.base_model.model.lin.oft_R["default"].weight.grad
    g_ours = ours.base_model.model.lin.poet_oft_R["default"].grad * (-1 if exact else 1)
    assert (g_theirs - g_ours).abs().max() <= 1e-5 * g_theirs.abs().max()


def test_peft_exact_cayley_is_the_transpose_so_the_mapping_negates():
    # float64: the two exact transforms then differ by rounding only, which γ_n bounds on any machine.
    peft_config = OFTConfig(oft_block_size=16, target_modules=["lin"], use_cayley_neumann=False)
    theirs = get_peft_model(OneLinear().double(), peft_config)
    with torch.no_grad():
        param = theirs.base_model.model.lin.oft_R["default"].weight
        param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64) * 0.05)
    state = get_peft_model_state_dict(theirs)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    errors = {}
    for negate in (True, False):
        ours = get_peft_model(OneLinear().double(), OftConfig.from_peft_config(peft_config))
        set_peft_model_state_dict(ours, peft_oft_state_dict_to_ours(state, exact_cayley=negate))
        errors[negate] = float((theirs(x) - ours(x)).abs().max())
    layer = ours.base_model.model.lin
    # Each side computes y = x·R·Wᵀ + b within γ_(16+64) of |x||R||W|ᵀ (a block solve or LU, then two products).
    scale = float((x.abs() @ dense_rotation(layer).abs() @ layer.get_base_layer().weight.abs().T.double()).max())
    assert errors[True] <= 2 * gamma(16 + 64, torch.float64) * scale and errors[False] > 1e-2


def test_peft_terms_below_three_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="num_cayley_neumann_terms`=2"):
        OftConfig.from_peft_config(OFTConfig(oft_block_size=16, num_cayley_neumann_terms=2))


def test_coft_projection_matches_peft():
    peft_config = OFTConfig(oft_block_size=16, target_modules=["lin"], coft=True, eps=1e-2)
    theirs = get_peft_model(OneLinear(), peft_config)
    with torch.no_grad():  # two blocks far outside the ball, two inside
        param = theirs.base_model.model.lin.oft_R["default"].weight
        param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(5)) * 1e-4)
        param[0] *= 1000
        param[2] *= 300
    ours = get_peft_model(OneLinear(), OftConfig.from_peft_config(peft_config))
    set_peft_model_state_dict(ours, peft_oft_state_dict_to_ours(get_peft_model_state_dict(theirs), False))
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(6))
    assert (theirs(x) - ours(x)).abs().max() <= 1e-6
    projected = ours.base_model.model.lin.poet_oft_R["default"].detach()
    torch.testing.assert_close(
        projected, theirs.base_model.model.lin.oft_R["default"].weight.detach(), rtol=1e-6, atol=1e-9
    )
    # Independent check of the projection: ||Q_i||_F = min(original, eps / sqrt(num_blocks)).
    radius = 1e-2 / math.sqrt(4)
    norms = torch.stack([torch.linalg.matrix_norm(skew_dense(row.double(), 16)) for row in projected])
    assert torch.allclose(norms[[0, 2]], torch.full((2,), radius, dtype=torch.float64), rtol=1e-5)
    assert (norms[[1, 3]] < radius).all()


def test_weights_round_trip_through_disk_both_ways(tmp_path):
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(7))
    peft_config = OFTConfig(oft_block_size=8, target_modules=["lin"], init_weights=False, bias="oft_only")
    theirs = get_peft_model(OneLinear(), peft_config)
    with torch.no_grad():
        theirs.base_model.model.lin.base_layer.bias.add_(0.5)  # a trained bias travels too
    theirs.save_pretrained(tmp_path / "peft")
    converted = peft_oft_state_dict_to_ours(load_file(tmp_path / "peft" / "adapter_model.safetensors"), False)
    ours = get_peft_model(OneLinear(), OftConfig.from_peft_config(peft_config))
    set_peft_model_state_dict(ours, converted)
    assert (ours(x) - theirs(x)).abs().max() <= 1e-6

    ours.save_pretrained(tmp_path / "ours")
    reloaded = PeftModel.from_pretrained(OneLinear(), tmp_path / "ours")  # our type, beside PEFT's own OFT
    assert type(reloaded.base_model).__name__ == "OftModel" and type(theirs.base_model).__name__ == "OFTModel"
    assert (reloaded(x) - theirs(x)).abs().max() <= 1e-6
    back = our_oft_state_dict_to_peft(load_file(tmp_path / "ours" / "adapter_model.safetensors"), False)
    fresh = get_peft_model(OneLinear(), OFTConfig(oft_block_size=8, target_modules=["lin"], bias="oft_only"))
    result = set_peft_model_state_dict(fresh, back)
    assert not result.unexpected_keys
    assert (fresh(x) - theirs(x)).abs().max() <= 1e-6


def test_merged_or_permuted_adapters_do_not_pretend_to_map_to_peft():
    model = get_peft_model(OneLinear(), OftConfig(block_size=16, target_modules=["lin"], spo="block"))
    with pytest.raises(ValueError, match="permutation"):
        our_oft_state_dict_to_peft(get_peft_model_state_dict(model), False)
    model = get_peft_model(OneLinear(), OftConfig(block_size=16, target_modules=["lin"]))
    merge_and_reinit(model)
    with pytest.raises(ValueError, match="merge-then-reinitialize"):
        our_oft_state_dict_to_peft(get_peft_model_state_dict(model), False)


# --- identity at init, targets, dense reference for Linear / Conv1D ---------------------------------------------------
@pytest.mark.parametrize("build", [tiny_llama, tiny_gpt2])
def test_identity_at_init_and_dense_reference(build):
    with torch.no_grad():
        reference = build()(input_ids=IDS).logits
        model = get_peft_model(build(), OftConfig(block_size=16, neumann_terms=5))
        assert (model(input_ids=IDS).logits - reference).abs().max() <= 1e-6
    set_random_skew(model, std=0.03)
    for name, layer in oft_layers(model):
        dense = layer.weight_matrix().detach().double() @ dense_rotation(layer).T
        effective = layer.effective_weight_matrix(dtype=torch.float64).detach()
        assert (effective - dense).abs().max() <= 1e-10 * dense.abs().max(), name


def test_default_targets_are_poets_and_r_sets_blocks_per_layer():
    model = get_peft_model(tiny_llama(), OftConfig(r=4, block_size=0))
    names = {n.rsplit(".", 1)[-1] for n, _ in oft_layers(model)}
    assert names == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    for name, layer in oft_layers(model):
        spec = layer.rotation_specs["default"]["input"]
        assert spec.num_blocks == 4 and spec.block == layer.in_features // 4, name
        assert layer.poet_oft_R["default"].shape == (4, spec.block * (spec.block - 1) // 2)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".poet_oft_R." in n for n in trainable)


# --- 2. Conv2d: weight-side, exact for every kernel, stride, padding, dilation ----------------------------------------
CONV_CASES = [(k, s, p, 1) for k, s, p in itertools.product([1, 3, 5], [1, 2], [0, 1])] + [(3, 1, 1, 2)]


@pytest.mark.parametrize("kernel,stride,padding,dilation", CONV_CASES)
def test_conv2d_is_base_conv_at_init_and_merged_conv_after(kernel, stride, padding, dilation):
    x = torch.randn(2, 4, 11, 11, generator=torch.Generator().manual_seed(8))
    base = OneConv(kernel, stride, padding, dilation)
    model = get_peft_model(
        OneConv(kernel, stride, padding, dilation), OftConfig(r=2, block_size=0, target_modules=["conv"])
    )
    with torch.no_grad():
        assert (model(x) - base(x)).abs().max() <= 1e-6
    set_random_skew(model, std=0.05)
    layer = model.base_model.model.conv
    w = base.conv.weight.detach().double()
    merged = (w.reshape(w.shape[0], -1) @ dense_rotation(layer).T).reshape(w.shape)
    expected = F.conv2d(x.double(), merged, base.conv.bias.double(), stride, padding, dilation)
    with torch.no_grad():
        got = model(x)
        assert (got.double() - expected).abs().max() <= 1e-5
        assert (got - base(x)).abs().max() > 1e-2  # the adapter does something
        plain = model.merge_and_unload()
        assert (plain(x).double() - expected).abs().max() <= 1e-5


@pytest.mark.numerics
@pytest.mark.parametrize(
    "padding,padding_mode", [(1, "zeros"), ((1, 2), "zeros"), ("same", "zeros"), ("valid", "zeros"), (1, "reflect")]
)
def test_conv2d_with_any_padding_matches_torch_conv_and_its_gradients_check(padding, padding_mode):
    # String paddings and non-zero padding modes pad the input first; the backward used to crash on "same"/"valid"
    # (convolution_backward takes no string). Reference: torch's own nn.Conv2d holding the dense merged weight, float64.
    torch.manual_seed(0)
    base = nn.Conv2d(4, 6, 3, padding=padding, padding_mode=padding_mode).double()
    holder = nn.Module()
    holder.conv = copy.deepcopy(base)
    model = get_peft_model(holder, OftConfig(r=2, block_size=0, target_modules=["conv"], init_weights=False))
    layer = model.base_model.model.conv
    x = torch.randn(1, 4, 7, 7, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    w = base.weight.detach()
    r = dense_rotation(layer)
    reference = copy.deepcopy(base)
    with torch.no_grad():
        reference.weight.copy_((w.reshape(6, -1) @ r.T).reshape(w.shape))
        got, expected = layer(x), reference(x)
        magnitudes = copy.deepcopy(reference)  # Σ|x||W_eff|: what every output entry sums, padding included
        magnitudes.weight.copy_((w.reshape(6, -1).abs() @ r.abs().T).reshape(w.shape))
        magnitudes.bias.abs_()
        scale = magnitudes(x.abs())
    # An output sums 36 products of the merged weight, itself 18-term dot products of W and a 6-term Cayley–Neumann
    # polynomial of an 18 × 18 block (both sides: ours in place, the reference by explicit powers).
    assert ((got - expected).abs() <= 2 * gamma(36 + 18 * 6 * 18, torch.float64) * scale).all()
    assert (got - layer.get_base_layer()(x)).abs().max() > 1e-2  # the adapter does something
    name, skew = next((n, p) for n, p in layer.named_parameters() if "poet_oft_R" in n)

    def output(x_: torch.Tensor, skew_: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(layer, {name: skew_}, (x_,))

    assert torch.autograd.gradcheck(output, (x.clone().requires_grad_(), skew.detach().clone().requires_grad_()))


@pytest.mark.parametrize("kernel,stride,padding", list(itertools.product([1, 3, 5], [1, 2], [0, 1])))
def test_peft_oft_conv2d_fails_the_same_check_for_kernels_above_one(kernel, stride, padding):
    """On record (peft 0.21.2): PEFT's OFT Conv2d rotates unfolded input patches and folds them back with
    F.fold, which sums overlapping patches, so for k > 1 it is neither the base conv at init nor its own merged
    conv. Ours, given PEFT's parameters, computes exactly PEFT's merged conv."""
    x = torch.randn(2, 4, 11, 11, generator=torch.Generator().manual_seed(8))
    base = OneConv(kernel, stride, padding)
    peft_config = OFTConfig(r=2, oft_block_size=0, target_modules=["conv"])
    theirs = get_peft_model(OneConv(kernel, stride, padding), peft_config)
    with torch.no_grad():
        init_error = float((theirs(x) - base(x)).abs().max())
        param = theirs.base_model.model.conv.oft_R["default"].weight
        param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(5)) * 0.05)
        adapter_out = theirs(x)
        ours = get_peft_model(OneConv(kernel, stride, padding), OftConfig.from_peft_config(peft_config))
        set_peft_model_state_dict(ours, peft_oft_state_dict_to_ours(get_peft_model_state_dict(theirs), False))
        ours_out = ours(x)
        merged_out = theirs.merge_and_unload()(x)
    merge_error = float((adapter_out - merged_out).abs().max())
    assert (ours_out - merged_out).abs().max() <= 1e-5
    if kernel == 1:
        assert init_error <= 1e-6 and merge_error <= 1e-5
    else:
        assert init_error > 1e-1 and merge_error > 1e-1, (init_error, merge_error)


@pytest.mark.parametrize("groups", [2, 4])
def test_grouped_conv_is_exact_too(groups):
    """R rotates each filter (in/groups·kh·kw); grouped and depthwise convs stay exact, unlike POET's P would."""
    torch.manual_seed(0)
    base = nn.Conv2d(4, 8, 3, padding=1, groups=groups)
    x = torch.randn(2, 4, 9, 9, generator=torch.Generator().manual_seed(8))
    model = get_peft_model(nn.Sequential(base), OftConfig(r=3, block_size=0, target_modules=["0"]))
    set_random_skew(model, std=0.05)
    layer = model.base_model.model[0]
    w = layer.get_base_layer().weight.detach().double()
    merged = (w.reshape(w.shape[0], -1) @ dense_rotation(layer).T).reshape(w.shape)
    expected = F.conv2d(x.double(), merged, layer.get_base_layer().bias.double(), padding=1, groups=groups)
    with torch.no_grad():
        assert (model(x).double() - expected).abs().max() <= 1e-5


# --- 3. merge / unmerge ---------------------------------------------------------------------------------------------
def _merge_unmerge(terms: int, std: float):
    model = get_peft_model(tiny_llama(), OftConfig(block_size=16, neumann_terms=terms))
    set_random_skew(model, std=std)
    layers = oft_layers(model)
    w0 = {n: layer.weight_matrix().detach().clone() for n, layer in layers}
    with torch.no_grad():
        expected = model(input_ids=IDS).logits
        model.merge_adapter()
        merged_logits = model(input_ids=IDS).logits
    merged = {n: layer.weight_matrix().detach().clone() for n, layer in layers}
    model.unmerge_adapter()
    return model, layers, w0, merged, (merged_logits - expected).abs().max()


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.linalg.matrix_norm(a.double() - b.double()) / torch.linalg.matrix_norm(b.double()))


def float32_merge_bound(block: int, terms: int) -> float:
    """Relative (Frobenius) error of a float32 merge ``W·Rᵀ`` with nearly orthogonal ``b × b`` blocks: evaluating
    the rotation takes at most ``terms`` block products (an LU solve counts as 3 for the exact transform), the merge
    one more, each within ``γ_b·√b`` (a row of |R| has ℓ1 norm ≤ √b), and storing it rounds once more."""
    products = (terms or 3) + 1
    return products * gamma(block, torch.float32) * block**0.5 + unit_roundoff(torch.float32)


def test_merge_unmerge_exact_cayley_restores_by_transpose():
    model, layers, w0, _, logit_error = _merge_unmerge(terms=0, std=0.1)
    assert logit_error <= 1e-5
    for name, layer in layers:
        report = layer.unmerge_report["default"]
        assert report["input"]["method"] == "transpose", name
        # The unmerge runs in float64; only its final rounding to float32 adds to the merge's error.
        bound = float32_merge_bound(16, terms=0) + unit_roundoff(torch.float32)
        assert _relative(layer.weight_matrix().detach(), w0[name]) <= bound, name


def test_merge_unmerge_neumann_solves_within_its_rounding_bound_and_reports_its_size():
    model, layers, w0, merged, logit_error = _merge_unmerge(terms=5, std=0.1)
    assert logit_error <= 1e-5
    # Capped at ||Q||_2 ≤ MAX_SKEW_NORM, the 5-term blocks have singular values in [1 − 0.75⁴, 1]: condition κ ≤ 1.46.
    # The solve amplifies the float32 merge's error and the weight's two roundings by at most κ.
    kappa = 1 / (1 - MAX_SKEW_NORM**4)
    bound = float32_merge_bound(16, terms=5) * kappa + unit_roundoff(torch.float32) * (1 + kappa)
    for name, layer in layers:
        report = layer.unmerge_report["default"]
        assert report["input"]["method"] == "solve", name
        error = _relative(layer.weight_matrix().detach(), w0[name])
        assert error <= bound, name
        # The report's figure is an estimate (probabilistic √b growth), not the worst case: it is the error's size.
        assert report["error_bound"] <= 1e-5 and error <= 10 * report["error_bound"], name
        # Why the solve: undoing by the transpose (W1 · R) would leave the Neumann error in the weight.
        by_transpose = merged[name].double() @ dense_rotation(layer)
        assert _relative(by_transpose, w0[name]) > 100 * report["error_bound"], name


def test_small_rotations_unmerge_by_transpose_even_with_neumann():
    _, layers, w0, _, _ = _merge_unmerge(terms=5, std=1e-4)
    for name, layer in layers:
        assert layer.unmerge_report["default"]["input"]["method"] == "transpose", name
        assert _relative(layer.weight_matrix().detach(), w0[name]) <= 1e-6, name


# --- merge-then-reinitialize: the block-stochastic form -------------------------------------------------------------
@pytest.mark.parametrize("spo", ["contiguous", "block"])
def test_merge_and_reinit_keeps_logits_and_resamples_only_for_block(spo):
    model = get_peft_model(tiny_llama(), OftConfig(block_size=16, spo=spo, seed=3))
    set_random_skew(model, std=0.05)
    before_index = {n: layer.poet_oft_R_index["default"].clone() for n, layer in oft_layers(model)}
    with torch.no_grad():
        before = model(input_ids=IDS).logits
    info = merge_and_reinit(model)
    assert info["merge_count"] == 1
    with torch.no_grad():
        assert (model(input_ids=IDS).logits - before).abs().max() <= 1e-5
    for name, layer in oft_layers(model):
        assert layer.poet_oft_R["default"].abs().max() == 0
        index = layer.poet_oft_R_index["default"]
        if spo == "contiguous":
            assert index.numel() == 0
        else:
            assert sorted(index.tolist()) == list(range(layer.in_features))
            assert not torch.equal(index, before_index[name]), name


def test_save_reload_is_exact_after_block_stochastic_merges(tmp_path):
    model = get_peft_model(tiny_llama(), OftConfig(block_size=16, spo="block", merge_every=5, seed=2))
    for seed in range(2):
        set_random_skew(model, std=0.05, seed=seed)
        merge_and_reinit(model)
    set_random_skew(model, std=0.05, seed=7)  # a live rotation too
    with torch.no_grad():
        expected = model(input_ids=IDS).logits
    model.save_pretrained(tmp_path)
    reloaded = PeftModel.from_pretrained(tiny_llama(), tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=IDS).logits, expected, rtol=0, atol=0)
    for (name, a), (_, b) in zip(oft_layers(model), oft_layers(reloaded), strict=True):
        assert torch.equal(a.poet_oft_R_index["default"], b.poet_oft_R_index["default"]), name
        assert int(b.poet_oft_merge_count["default"]) == 2


# --- module dropout ---------------------------------------------------------------------------------------------------
def test_module_dropout_replaces_exactly_int_p_blocks_by_identity_in_training_only():
    model = get_peft_model(OneLinear(), OftConfig(block_size=16, target_modules=["lin"], module_dropout=0.5))
    set_random_skew(model, std=0.1)
    layer = model.base_model.model.lin
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(9))
    w = layer.weight_matrix().detach().double()
    bias = layer.get_base_layer().bias.detach().double()
    full = dense_rotation(layer)
    candidates = []
    for dropped in itertools.combinations(range(4), 2):  # int(0.5 · 4) = 2 blocks become I
        rotation = full.clone()
        for i in dropped:
            rotation[16 * i : 16 * (i + 1), 16 * i : 16 * (i + 1)] = torch.eye(16, dtype=torch.float64)
        candidates.append(x.double() @ rotation @ w.T + bias)
    model.eval()
    with torch.no_grad():
        assert (model(x).double() - (x.double() @ full @ w.T + bias)).abs().max() <= 1e-5
    model.train()
    seen = set()
    for _ in range(12):
        with torch.no_grad():
            y = model(x).double()
        errors = [float((y - c).abs().max()) for c in candidates]
        assert min(errors) <= 1e-5
        seen.add(errors.index(min(errors)))
    assert len(seen) > 1  # the dropped blocks are redrawn
    model.train(False)
    model.merge_adapter()  # merging never drops blocks
    assert _relative(layer.weight_matrix().detach(), w @ full.T) <= float32_merge_bound(16, terms=5)


# --- 5. hyperspherical energy ----------------------------------------------------------------------------------------
def hyperspherical_energy(weight: torch.Tensor) -> float:
    """Σ_{i<j} 1 / ||ŵ_i − ŵ_j|| over the neurons (rows of the torch weight), in float64."""
    w = weight.double()
    w = w / w.norm(dim=1, keepdim=True)
    i, j = torch.triu_indices(w.shape[0], w.shape[0], offset=1)
    return float((1 / (w[i] - w[j]).norm(dim=1)).sum())


@pytest.mark.parametrize("terms", [0, 5])
def test_fine_tuned_oft_preserves_hyperspherical_energy_to_the_neumann_error(terms):
    torch.manual_seed(0)
    pretrained = tiny_llama()
    w0 = {n: m.weight.detach().clone() for n, m in pretrained.named_modules() if isinstance(m, nn.Linear)}
    model = get_peft_model(pretrained, OftConfig(block_size=16, neumann_terms=terms))
    model.train()
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=5e-3)
    data = torch.randint(0, 128, (8, 16), generator=torch.Generator().manual_seed(10))
    for step in range(8):
        batch = data[(step % 4) * 2 : (step % 4) * 2 + 2]
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    # ε = max_i ||Q_i||_2^(k-1): R_k = R_exact (I − Q^(k-1)) distorts lengths by at most ε, so the normalised map
    # w ↦ R_k w / ||R_k w|| is L-Lipschitz on the sphere both ways with L = (1+ε)/(1−ε); chord lengths (and so
    # each 1/||ŵ_i − ŵ_j||) change by a factor in [1/L, L], and |HE'/HE − 1| <= L − 1 = 2ε/(1−ε).
    eps, rotations = {}, {}
    for name, layer in oft_layers(model):
        key = name.removeprefix("base_model.model.")
        thetas = [
            torch.linalg.matrix_norm(skew_dense(row.detach().double(), 16), ord=2)
            for row in layer.poet_oft_R["default"]
        ]
        eps[key] = 0.0 if terms == 0 else float(max(thetas)) ** (terms - 1)
        rotations[key] = dense_rotation(layer)
    assert max(thetas) > 0.05  # training really rotated
    merged = model.merge_and_unload()
    for name, module in merged.named_modules():
        if name not in rotations:
            continue
        he0, he = hyperspherical_energy(w0[name]), hyperspherical_energy(module.weight.detach())
        e = eps[name]
        assert abs(he / he0 - 1) <= 2 * e / (1 - e) + 1e-6, (name, he / he0 - 1, e)
        # The merged weight is W0 · R^T with the float64 reference R, to float32 precision ...
        he_reference = hyperspherical_energy(w0[name].double() @ rotations[name].T)
        assert abs(he / he_reference - 1) <= 1e-6, name
        # ... a precision at which a LoRA-like (rank-1) update of the same size is far off.
        delta = module.weight.detach().double() - w0[name].double()
        g = torch.Generator().manual_seed(11)
        low_rank = torch.randn(delta.shape[0], 1, generator=g, dtype=torch.float64) @ torch.randn(
            1, delta.shape[1], generator=g, dtype=torch.float64
        )
        control = w0[name].double() + low_rank * delta.norm() / low_rank.norm()
        assert abs(hyperspherical_energy(control) / he0 - 1) > 1e-5, name


# --- config validation ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "fields,named",
    [
        ({"r": 4}, "`r`"),
        ({"r": 0, "block_size": 0}, "`r`"),
        ({"block_size": 1}, "`block_size`"),
        ({"neumann_terms": 1}, "`neumann_terms`"),
        ({"module_dropout": 1.0}, "`module_dropout`"),
        ({"module_dropout": 0.1, "block_share": True}, "`module_dropout`"),
        ({"eps": 0.0}, "`eps`"),
        ({"spo": "full"}, "`spo`"),
        ({"bias": "poet_only"}, "`bias`"),
        ({"forward": "fast"}, "`forward`"),
        ({"merge_every": 0}, "`merge_every`"),
        ({"coft": "yes"}, "`coft`"),
    ],
)
def test_bad_config_fields_are_named(fields, named):
    with pytest.raises(ValueError, match=named):
        OftConfig(**fields)


def test_block_size_that_does_not_divide_is_rejected_at_build_time_when_strict():
    with pytest.raises(ValueError, match="`block_size`=24 does not divide"):
        get_peft_model(tiny_llama(), OftConfig(block_size=24, strict_block_size=True))
    with pytest.raises(ValueError, match="`r`=5 does not divide"):
        get_peft_model(tiny_llama(), OftConfig(r=5, block_size=0, strict_block_size=True))
