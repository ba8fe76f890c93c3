"""The POET tuner against dense float64 references and the base models."""

import json
import textwrap
from pathlib import Path

import prewarmed
import pytest
import torch
from models import TinyCNN, tiny_bert, tiny_gpt2, tiny_llama
from peft import PeftModel, get_peft_model
from reference import block_rotation_dense, cayley_inverse, neumann_series, subset_rotation_dense
from tolerances import gamma, tiny_model_tolerance

from poet_hf import PoetConfig, merge_and_reinit
from poet_hf.orthogonal import neumann_error_bound, skew_from_vector
from poet_hf.tuners.poet import PoetLayer
from poet_hf.tuners.rotation.layer import rotation_layers

IDS = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
IMAGES = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(2))


def outputs(model, kind):
    if kind == "cnn":
        return model(IMAGES.to(next(model.parameters()).dtype))
    out = model(input_ids=IDS)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def build(kind):
    return {"llama": tiny_llama, "gpt2": tiny_gpt2, "bert": tiny_bert, "cnn": TinyCNN}[kind]()


def poet(kind, **overrides):
    fields = {"block_size": 4 if kind == "cnn" else 16}
    if kind == "cnn":
        fields["target_modules"] = ["conv1", "conv2", "head"]
    fields.update(overrides)
    return get_peft_model(build(kind), PoetConfig(**fields))


@torch.no_grad()
def randomize(model, op_norm=0.1, seed=3):
    generator = torch.Generator().manual_seed(seed)
    for _, layer in rotation_layers(model):
        for a in layer.rotation_specs:
            layer.randomize_adapter(a, generator, op_norm)


# --- 1. identity at init -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["llama", "gpt2", "bert", "cnn"])
@pytest.mark.parametrize("spo", ["block", "full"])
@pytest.mark.numerics
def test_identity_at_init(kind, spo):
    # In float64, so that what is left is rounding: folding a permutation into W0 reorders its dot products.
    with torch.no_grad():
        reference = outputs(build(kind).double(), kind)
        model = poet(kind, spo=spo).double()
        assert len(rotation_layers(model)) > 0
        assert (outputs(model, kind) - reference).abs().max() <= tiny_model_tolerance(
            torch.float64
        ) * reference.abs().max()


@pytest.mark.parametrize("kind", ["vit", "gpt_neox"])
def test_default_targets_of_other_architectures(kind):
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, ViTConfig, ViTModel

    if kind == "vit":
        base = ViTModel(
            ViTConfig(
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=2,
                intermediate_size=64,
                image_size=16,
                patch_size=8,
            )
        )
    else:
        base = GPTNeoXForCausalLM(
            GPTNeoXConfig(
                hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, vocab_size=64
            )
        )
    names = [n for n, _ in rotation_layers(get_peft_model(base, PoetConfig(block_size=16)))]
    assert len(names) == 2 * (6 if kind == "vit" else 4)
    assert not any("pooler" in n or "lm_head" in n or "embed" in n for n in names)


def test_default_targets_cover_block_linears_only():
    names = {n.rsplit(".", 1)[-1] for n, _ in rotation_layers(poet("llama"))}
    assert names == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    bert_names = [n for n, _ in rotation_layers(poet("bert"))]
    assert len(bert_names) == 2 * 6 and not any("pooler" in n or "embeddings" in n for n in bert_names)
    gpt2_names = [n for n, _ in rotation_layers(poet("gpt2"))]
    assert len(gpt2_names) == 2 * 4 and not any("lm_head" in n or "wte" in n for n in gpt2_names)


# --- 2. spectrum and dense reference -------------------------------------------------------------------------------
def dense_effective_weight(layer: PoetLayer, adapter="default"):
    """P^T W0 R^T in float64 from explicit permutation / selection / block-diagonal matrices."""
    w = layer.weight_matrix().detach().double()
    terms = layer.rotation_settings[adapter].orthogonal_map.terms
    rotations = {}
    for side, spec in layer.rotation_specs[adapter].items():
        param = (layer.poet_R if side == "input" else layer.poet_P)[adapter].detach().double()
        index = (layer.poet_R_index if side == "input" else layer.poet_P_index)[adapter]
        qs = skew_from_vector(param, spec.block)
        blocks = torch.stack([cayley_inverse(q) if terms == 0 else neumann_series(q, terms) for q in qs])
        if spec.kind == "full":
            rotations[side] = subset_rotation_dense(index, blocks[0], spec.dim)
        else:
            rotations[side] = block_rotation_dense(index if spec.kind == "block" else None, blocks)
    r = rotations.get("input", torch.eye(w.shape[1], dtype=torch.float64))
    p = rotations.get("output", torch.eye(w.shape[0], dtype=torch.float64))
    return p.T @ w @ r.T, rotations


@pytest.mark.numerics
@pytest.mark.parametrize("kind", ["llama", "gpt2", "cnn"])
@pytest.mark.parametrize("spo", ["block", "full"])
@pytest.mark.parametrize("terms", [0, 5])
def test_effective_weight_spectrum_and_dense_reference(kind, spo, terms):
    model = poet(kind, spo=spo, neumann_terms=terms)
    randomize(model, op_norm=0.1)
    for name, layer in rotation_layers(model):
        effective = layer.effective_weight_matrix(dtype=torch.float64).detach()
        dense, _ = dense_effective_weight(layer)
        assert (effective - dense).abs().max() <= 1e-10 * dense.abs().max(), name
        s0 = torch.linalg.svdvals(layer.weight_matrix().detach().double())
        s = torch.linalg.svdvals(effective)
        rel = ((s - s0).abs() / s0.max()).max()
        if terms == 0:
            assert rel <= 1e-5, name
        else:
            # σ_i(P^T W R^T) / σ_i(W) lies in [(1-ε_R)(1-ε_P), (1+ε_R)(1+ε_P)] (multiplicative Weyl).
            eps = [
                float(neumann_error_bound(skew_from_vector(p.detach().double(), spec.block), terms).max())
                for side, spec in layer.rotation_specs["default"].items()
                for p in [(layer.poet_R if side == "input" else layer.poet_P)["default"]]
            ]
            bound = torch.prod(torch.tensor(eps) + 1) - 1
            assert bound > 1e-9  # the check is not vacuous: CNP really is inexact here
            assert ((s - s0).abs() / s0).max() <= bound * (1 + 1e-6) + 1e-12, name


@pytest.mark.numerics
# --- 3. merge_and_reinit -------------------------------------------------------------------------------------------
def test_merge_and_reinit_keeps_logits_zeroes_q_and_resamples():
    model = poet("llama")
    randomize(model, op_norm=0.2)
    with torch.no_grad():
        before = outputs(model, "llama")
    perms_before = {n: layer.poet_R_index["default"].clone() for n, layer in rotation_layers(model)}
    info = merge_and_reinit(model)
    assert info["layers"] == 14 and info["merge_count"] == 1 and info["max_q_norm"] > 0.1
    with torch.no_grad():
        after = outputs(model, "llama")
    assert (after - before).abs().max() <= 1e-5
    for name, layer in rotation_layers(model):
        assert layer.poet_R["default"].abs().max() == 0 and layer.poet_P["default"].abs().max() == 0
        assert not torch.equal(layer.poet_R_index["default"], perms_before[name])


def test_merge_permutations_reproduce_in_a_fresh_process(tmp_path):
    model = poet("llama", seed=11)
    merge_and_reinit(model)
    merge_and_reinit(model)
    here = {n: layer.poet_P_index["default"].tolist() for n, layer in rotation_layers(model)}
    # A new process that has drawn nothing (forked from the imports-only server of tests/helpers/prewarmed.py).
    (tmp_path / "merges.py").write_text(
        textwrap.dedent(f"""
        import json, sys; sys.path.insert(0, {str(Path(__file__).parent)!r})
        from peft import get_peft_model
        from poet_hf import PoetConfig, merge_and_reinit
        from poet_hf.tuners.rotation.layer import rotation_layers
        from models import tiny_llama
        model = get_peft_model(tiny_llama(), PoetConfig(block_size=16, seed=11))
        merge_and_reinit(model); merge_and_reinit(model)
        indices = {{n: layer.poet_P_index['default'].tolist() for n, layer in rotation_layers(model)}}
        open(sys.argv[1], 'w').write(json.dumps(indices))
    """)
    )
    prewarmed.run(tmp_path / "merges.py", [tmp_path / "merges.json"], tmp_path / "merges.log")
    assert json.loads((tmp_path / "merges.json").read_text()) == here


# --- 4. parameter counts of the paper's Table 2 -----------------------------------------------------------------------
@pytest.mark.parametrize(
    "size,spo,value,expected",
    [
        ("60m", "block", 256, 9.66),
        ("130m", "block", 256, 22.33),
        ("60m", "block", 128, 4.81),
        ("130m", "block", 128, 11.12),
        ("60m", "full", 0.5, 8.54),
        ("130m", "full", 0.5, 28.56),
    ],
)
def test_trainable_parameter_counts_match_table_2(size, spo, value, expected):

    hidden, heads, layers = {"60m": (512, 8, 8), "130m": (768, 12, 12)}[size]
    # Table 7: BS uses 1280 / 2048; FS uses GaLore's 1376 / 2048.
    intermediate = {("60m", "block"): 1280, ("130m", "block"): 2048, ("60m", "full"): 1376, ("130m", "full"): 2048}[
        (size, spo)
    ]
    base = tiny_llama(meta=True, hidden=hidden, intermediate=intermediate, layers=layers, vocab=32000, heads=heads)
    kwargs = {"block_size": value} if spo == "block" else {"budget": value}
    model = get_peft_model(base, PoetConfig(spo=spo, **kwargs))
    trainable = sum(p.numel() for n, p in model.named_parameters() if p.requires_grad)
    assert abs(trainable / 1e6 - expected) <= 0.01


# --- 5. weight vs activation strategy ---------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["llama", "gpt2"])
@pytest.mark.parametrize("spo", ["block", "full"])
@pytest.mark.numerics
def test_weight_and_activation_strategies_agree_in_forward_and_gradients(kind, spo):
    # The two strategies associate the same products differently; in float64 that leaves rounding.
    results = {}
    for strategy in ("weight", "activation"):
        model = poet(kind, spo=spo, forward=strategy).double()
        randomize(model, op_norm=0.3)
        out = outputs(model, kind)
        out.square().mean().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        results[strategy] = (out.detach(), grads)
    (out_w, grads_w), (out_a, grads_a) = results["weight"], results["activation"]
    tolerance = tiny_model_tolerance(torch.float64, backward=True)
    assert ((out_w - out_a).abs().max() / out_w.abs().max()) <= tolerance
    for name in grads_w:
        assert ((grads_w[name] - grads_a[name]).abs().max() / grads_w[name].abs().max()) <= tolerance, name


def test_cost_model_picks_activation_for_few_tokens_and_weight_for_many():
    model = poet("llama", block_size=16)
    layer = rotation_layers(model)[0][1]
    assert layer.choose_strategy("default", tokens=4, training=False) == "activation"
    assert layer.choose_strategy("default", tokens=4096, training=False) == "weight"


# --- 6. save / reload after merges ------------------------------------------------------------------------------------
@pytest.mark.parametrize("spo", ["block", "full"])
def test_save_reload_is_exact_after_merges(tmp_path, spo):
    model = poet("llama", spo=spo)
    for _ in range(2):
        randomize(model, op_norm=0.2, seed=_)
        merge_and_reinit(model)
    randomize(model, op_norm=0.2, seed=9)  # a live, non-identity primitive too
    with torch.no_grad():
        expected = outputs(model, "llama")
    model.save_pretrained(tmp_path)
    reloaded = PeftModel.from_pretrained(tiny_llama(), tmp_path)
    with torch.no_grad():
        got = outputs(reloaded, "llama")
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    for (name, a), (_, b) in zip(rotation_layers(model), rotation_layers(reloaded), strict=True):
        assert torch.equal(a.poet_R_index["default"], b.poet_R_index["default"]), name
        assert int(b.poet_merge_count["default"]) == 2


def test_reload_reports_no_missing_or_unexpected_adapter_keys(tmp_path):
    from peft.utils import set_peft_model_state_dict
    from safetensors.torch import load_file

    model = poet("llama")
    merge_and_reinit(model)
    model.save_pretrained(tmp_path)
    fresh = get_peft_model(tiny_llama(), PoetConfig(block_size=16))
    result = set_peft_model_state_dict(fresh, load_file(tmp_path / "adapter_model.safetensors"))
    assert not result.unexpected_keys
    assert not [k for k in result.missing_keys if ".poet_" in k]


# --- 7. merge_and_unload -> stock transformers ------------------------------------------------------------------------
def test_merge_and_unload_gives_plain_model_loadable_without_poet_hf(tmp_path, stock_python):
    model = poet("llama")
    randomize(model, op_norm=0.2)
    merge_and_reinit(model)
    randomize(model, op_norm=0.2, seed=5)
    with torch.no_grad():
        expected = outputs(model, "llama")
    plain = model.merge_and_unload()
    assert not any(isinstance(m, PoetLayer) for m in plain.modules())
    assert type(plain).__name__ == "LlamaForCausalLM"
    with torch.no_grad():
        assert (outputs(plain, "llama") - expected).abs().max() <= 1e-5
    plain.save_pretrained(tmp_path)
    torch.save(IDS, tmp_path / "ids.pt")
    torch.save(expected, tmp_path / "expected.pt")
    code = textwrap.dedent(f"""
        import sys, torch
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained({str(tmp_path)!r}).eval()
        ids, expected = torch.load({str(tmp_path / "ids.pt")!r}), torch.load({str(tmp_path / "expected.pt")!r})
        with torch.no_grad():
            diff = (model(input_ids=ids).logits - expected).abs().max().item()
        assert 'poet_hf' not in sys.modules
        print(diff)
    """)
    done = stock_python.run(code, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert float(done.stdout.strip().splitlines()[-1]) <= 1e-5


@pytest.mark.numerics
def test_peft_merge_unmerge_restores_base_and_keeps_adapter():
    # float64 and a truncated series (3 terms, ||Q|| = 0.3: blocks off orthogonal by 0.09, condition < 1.2), so the
    # unmerge must solve. Merge and unmerge are four 16-long block products per weight, far inside the model's bound.
    model = poet("llama", neumann_terms=3).double()
    randomize(model, op_norm=0.3)
    layer = rotation_layers(model)[0][1]
    w0 = layer.weight_matrix().detach().clone()
    skew = layer.poet_R["default"].detach().clone()
    with torch.no_grad():
        expected = outputs(model, "llama")
        model.merge_adapter()
        assert (outputs(model, "llama") - expected).abs().max() <= tiny_model_tolerance(
            torch.float64
        ) * expected.abs().max()
        model.unmerge_adapter()
    assert ((layer.weight_matrix() - w0).abs().max() / w0.abs().max()) <= tiny_model_tolerance(torch.float64)
    assert torch.equal(layer.poet_R["default"].detach(), skew)


# --- 8. bad configs ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "field,value",
    [
        ("spo", "diagonal"),
        ("budget", 0.0),
        ("budget", 1.5),
        ("block_size", 1),
        ("sides", "left"),
        ("neumann_terms", 1),
        ("merge_every", 0),
        ("base_init", "orthogonal"),
        ("forward", "fast"),
        ("bias", "lora_only"),
    ],
)
def test_bad_config_fields_are_named(field, value):
    with pytest.raises(ValueError, match=f"`{field}`"):
        PoetConfig(**{field: value})


def test_block_size_that_does_not_divide_is_rejected_at_build_time_when_strict():
    with pytest.raises(ValueError, match="`block_size`=24 does not divide"):
        get_peft_model(tiny_llama(), PoetConfig(block_size=24, strict_block_size=True))


def test_unsupported_target_type_is_rejected():
    with pytest.raises(ValueError, match="`target_modules`.*Embedding"):
        get_peft_model(tiny_llama(), PoetConfig(block_size=16, target_modules=["embed_tokens"]))


def test_activation_forward_on_conv2d_is_rejected():
    with pytest.raises(ValueError, match="`forward`='activation'"):
        poet("cnn", forward="activation")


@pytest.mark.numerics
# --- base_init --------------------------------------------------------------------------------------------------------
def test_normalized_base_init_gives_unit_norm_neurons_and_trainable_non_targets():
    model = poet("llama", base_init="normalized")
    for _, layer in rotation_layers(model):
        norms = layer.weight_matrix().detach().norm(dim=1)
        # Normalising a float32 row and measuring it again each sum n squares: within γ_(n+2) of 1 on both counts.
        torch.testing.assert_close(
            norms, torch.ones_like(norms), rtol=0, atol=2 * gamma(layer.in_features + 2, torch.float32)
        )
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert any("embed_tokens" in n for n in trainable) and any("norm" in n for n in trainable)
    assert not any("base_layer" in n for n in trainable)


@pytest.mark.numerics
def test_uniform_spectrum_base_init_has_unit_singular_values():
    model = poet("llama", base_init="uniform_spectrum")
    s = torch.linalg.svdvals(rotation_layers(model)[0][1].weight_matrix().detach().double())
    torch.testing.assert_close(s, torch.ones_like(s), rtol=0, atol=1e-5)


@pytest.mark.numerics
# --- multiple adapters ------------------------------------------------------------------------------------------------
def test_two_adapters_compose_like_the_dense_product_and_disable_restores_base():
    model = poet("llama", init_weights=False)
    model.add_adapter("second", PoetConfig(block_size=16, init_weights=False, seed=4))
    model.base_model.set_adapter(["default", "second"])
    layer = rotation_layers(model)[0][1]
    x = torch.randn(3, layer.in_features, dtype=torch.float64)
    w = layer.weight_matrix().detach().double()
    dense = w
    for adapter in ("default", "second"):
        _, rot = dense_effective_weight(layer, adapter)
        dense = rot["output"].T @ dense @ rot["input"].T
    got = layer(x.float()).detach().double()
    assert (got - x @ dense.T).abs().max() <= 1e-5
    with torch.no_grad(), model.disable_adapter():
        reference = outputs(tiny_llama(), "llama")
        assert (outputs(model, "llama") - reference).abs().max() <= 1e-6


# --- dtypes and versions ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("strategy", ["weight", "activation"])
def test_adapter_stays_float32_under_bfloat16_base(strategy):
    base = tiny_llama().to(torch.bfloat16)
    with torch.no_grad():
        reference = outputs(base, "llama")
    model = get_peft_model(base, PoetConfig(block_size=16, forward=strategy))
    assert {p.dtype for n, p in model.named_parameters() if p.requires_grad} == {torch.float32}
    with torch.no_grad():
        assert torch.equal(outputs(model, "llama"), reference)  # identity at init, in bfloat16 too
    randomize(model, op_norm=0.2)
    out = outputs(model, "llama")
    assert out.dtype == torch.bfloat16
    out.float().square().mean().backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads)


def test_unsupported_peft_version_is_refused_with_install_hint():
    from poet_hf.tuners.registry import check_peft_version

    check_peft_version("0.21.2")
    with pytest.raises(ImportError, match=r"peft>=0.21.0,<0.22.0"):
        check_peft_version("0.20.0")
