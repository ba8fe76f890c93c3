"""What PEFT users rely on with PEFT's own tuners holds for POET, OFT and the orthogonal tuner, through stock PEFT
entry points."""

import copy
import importlib
import itertools
import json
import math
import pickle

import pytest
import torch
from models import TinyCNN, tiny_gpt2, tiny_llama
from peft import PeftConfig, PeftModel, PeftType, get_peft_model
from peft.utils.other import fsdp_auto_wrap_policy
from torch import nn

import poet_hf  # noqa: F401
from poet_hf import OftConfig, OrthogonalConfig, PoetConfig, merge_and_reinit

IDS = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(1))
TUNERS = {
    "poet": lambda **kw: PoetConfig(block_size=16, **kw),
    "oft": lambda **kw: OftConfig(block_size=16, **kw),
    "orthogonal": lambda **kw: OrthogonalConfig(**kw),
}


def logits(model):
    with torch.no_grad():
        return model(input_ids=IDS).logits


# --- 1. peft_type is a PeftType member --------------------------------------------------------------------------------
@pytest.mark.parametrize("tuner", TUNERS)
def test_peft_type_is_the_enum_member_everywhere_and_the_string_on_disk(tmp_path, tuner):
    config = TUNERS[tuner](init_weights=False)
    assert isinstance(config.peft_type, PeftType)
    model = get_peft_model(tiny_llama(), config)
    model.save_pretrained(tmp_path)
    assert "library_name: peft" in (tmp_path / "README.md").read_text()  # PEFT wrote its model card
    raw = json.loads((tmp_path / "adapter_config.json").read_text())
    assert raw["peft_type"] == config.peft_type.value and type(raw["peft_type"]) is str
    fields = {k: v for k, v in raw.items() if k != "peft_type"}
    for loaded in (
        PeftConfig.from_pretrained(tmp_path),
        type(config).from_pretrained(tmp_path),
        PeftConfig.from_peft_type(peft_type=raw["peft_type"], **fields),
        pickle.loads(pickle.dumps(config)),
        copy.deepcopy(config),
    ):
        assert type(loaded) is type(config) and loaded.peft_type is config.peft_type
    reloaded = PeftModel.from_pretrained(tiny_llama(), tmp_path)
    assert reloaded.peft_config["default"].peft_type is config.peft_type
    expected = logits(model)
    for clone in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model), reloaded):
        torch.testing.assert_close(logits(clone), expected, rtol=0, atol=0)


@pytest.mark.parametrize("tuner", TUNERS)
def test_peft_fsdp_wrap_policy_wraps_the_decoder_layers_holding_our_adapters(tuner):
    model = get_peft_model(tiny_llama(), TUNERS[tuner]())
    policy = fsdp_auto_wrap_policy(model)
    decoder_layer = model.base_model.model.model.layers[0]
    assert any(p.requires_grad for p in decoder_layer.parameters())
    assert policy(module=decoder_layer, recurse=False, nonwrapped_numel=0)
    assert not policy(module=model.base_model.model.model.norm, recurse=False, nonwrapped_numel=0)


# --- 2. adapter dtype follows autocast_adapter_dtype ------------------------------------------------------------------
class EcoCNN(nn.Module):
    """A CNN whose convolutions the orthogonal tuner can make ECO convolutions (6 × 6 maps, 3 × 3 kernels)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv1 = nn.Conv2d(4, 8, 3, padding=1)
        self.head = nn.Linear(8 * 6 * 6, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.conv1(x)).flatten(1))


TARGETS = {  # (model, config fields, input) per target type and tuner
    "linear": (tiny_llama, {}, IDS),
    "conv1d": (tiny_gpt2, {}, IDS),
    "conv2d": (
        TinyCNN,
        {"target_modules": ["conv1", "conv2", "head"], "block_size": 4},
        torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(2)),
    ),
}


def _build(tuner: str, kind: str, dtype: torch.dtype, autocast_adapter_dtype: bool):
    if tuner == "orthogonal":
        build, fields, x = (
            (EcoCNN, {"target_modules": ["conv1", "head"], "conv_input_size": 6}, torch.randn(2, 4, 6, 6))
            if kind == "conv2d"
            else TARGETS[kind]
        )
    else:
        build, fields, x = TARGETS[kind]
    fields = {"block_size": 16, **fields} if tuner != "orthogonal" else fields
    config = {"poet": PoetConfig, "oft": OftConfig, "orthogonal": OrthogonalConfig}[tuner](init_weights=False, **fields)
    return get_peft_model(build().to(dtype), config, autocast_adapter_dtype=autocast_adapter_dtype), x


def _run(model, x, dtype):
    return model(x.to(dtype) if x.is_floating_point() else x) if x.is_floating_point() else model(input_ids=x).logits


DTYPE_CASES = [
    c
    for c in itertools.product(TUNERS, ["linear", "conv1d", "conv2d"], [torch.float16, torch.bfloat16], [True, False])
    if not (c[0] == "orthogonal" and c[1] == "conv1d")
]


@pytest.mark.parametrize("tuner,kind,dtype,autocast_adapter_dtype", DTYPE_CASES)
def test_adapter_dtype_follows_autocast_adapter_dtype(tuner, kind, dtype, autocast_adapter_dtype):
    model, x = _build(tuner, kind, dtype, autocast_adapter_dtype)
    expected = torch.float32 if autocast_adapter_dtype else dtype
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {expected}
    y = _run(model, x, dtype)
    assert y.dtype in (dtype, torch.float32) and torch.isfinite(y.float()).all()  # LM heads may upcast logits
    if kind == "conv2d":
        assert y.dtype == dtype
    with torch.autocast("cpu", dtype=dtype):
        y_autocast = _run(model, x, dtype)
    y_autocast.float().square().mean().backward()
    assert all(
        p.grad is not None and p.grad.dtype == expected and torch.isfinite(p.grad).all()
        for p in model.parameters()
        if p.requires_grad
    )
    model.merge_adapter()
    model.unmerge_adapter()
    if tuner != "orthogonal":
        merge_and_reinit(model)
    assert {p.dtype for n, p in model.named_parameters() if "base_layer" in n} == {dtype}
    assert {p.dtype for p in model.merge_and_unload().parameters()} == {dtype}


@pytest.mark.parametrize("tuner", TUNERS)
@pytest.mark.parametrize("autocast_adapter_dtype", [True, False])
def test_add_load_and_from_pretrained_follow_autocast_adapter_dtype(tmp_path, tuner, autocast_adapter_dtype):
    expected = torch.float32 if autocast_adapter_dtype else torch.bfloat16
    model = get_peft_model(tiny_llama().to(torch.bfloat16), TUNERS[tuner](), autocast_adapter_dtype=True)
    model.add_adapter("second", TUNERS[tuner](), autocast_adapter_dtype=autocast_adapter_dtype)
    second = {p.dtype for n, p in model.named_parameters() if ".second" in n and p.is_floating_point()}
    assert second == {expected}
    model.save_pretrained(tmp_path)
    reloaded = PeftModel.from_pretrained(
        tiny_llama().to(torch.bfloat16), tmp_path, autocast_adapter_dtype=autocast_adapter_dtype
    )
    reloaded.load_adapter(tmp_path / "second", "second", autocast_adapter_dtype=autocast_adapter_dtype)
    for name in ("default", "second"):
        dtypes = {p.dtype for n, p in reloaded.named_parameters() if f".{name}" in n and p.is_floating_point()}
        assert dtypes == {expected}, name


# --- 3. large steps stay finite ---------------------------------------------------------------------------------------
class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def _three_large_steps(config) -> torch.Tensor:
    model = get_peft_model(MLP(), config)
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(1))
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    for _ in range(3):
        model(x).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    with torch.no_grad():
        return model(x)


@pytest.mark.parametrize(
    "config",
    [PoetConfig(block_size=8, target_modules=["a", "b"]), PoetConfig(spo="full", target_modules=["a", "b"])],
    ids=["block", "full"],
)
def test_large_steps_leave_finite_outputs_and_the_cap_is_what_keeps_them(monkeypatch, caplog, config):
    with caplog.at_level("WARNING"):
        assert torch.isfinite(_three_large_steps(config)).all()
    norm_cap = importlib.import_module("poet_hf.orthogonal.norm_cap")
    monkeypatch.setattr(norm_cap, "MAX_SKEW_NORM", math.inf)  # today's unbounded series
    assert not torch.isfinite(_three_large_steps(config)).all()


def test_below_the_cap_rotations_are_bit_identical_to_the_uncapped_series(monkeypatch):
    from poet_hf.orthogonal import num_skew_params, orthogonal_from_vector, skew_from_vector

    norm_cap = importlib.import_module("poet_hf.orthogonal.norm_cap")
    vec = torch.randn(4, num_skew_params(16), generator=torch.Generator().manual_seed(3)) * 0.1
    assert float(torch.linalg.matrix_norm(skew_from_vector(vec, 16), ord=2).max()) < norm_cap.MAX_SKEW_NORM
    capped = orthogonal_from_vector(vec, 16, 5)
    monkeypatch.setattr(norm_cap, "MAX_SKEW_NORM", math.inf)
    assert torch.equal(capped, orthogonal_from_vector(vec, 16, 5))


@pytest.mark.parametrize("block", [16, 64, 256])
def test_beyond_the_cap_blocks_are_rescaled_onto_it_within_two_percent(block):
    from poet_hf.orthogonal import num_skew_params, skew_from_vector

    norm_cap = importlib.import_module("poet_hf.orthogonal.norm_cap")
    vec = torch.randn(6, num_skew_params(block), dtype=torch.float64, generator=torch.Generator().manual_seed(block))
    q = skew_from_vector(vec, block)
    q[::2] *= 0.1 / torch.linalg.matrix_norm(q[::2], ord=2)[:, None, None]  # every other block well inside
    exact = torch.linalg.matrix_norm(q, ord=2)  # float64 SVD, the independent reference
    scale = norm_cap.skew_norm_scale(q, 5).flatten()
    inside = exact < norm_cap.MAX_SKEW_NORM
    assert torch.equal(scale[inside], torch.ones_like(scale[inside]))
    capped = scale[~inside] * exact[~inside]
    assert (capped >= norm_cap.MAX_SKEW_NORM * (1 - 1e-9)).all() and (capped <= norm_cap.MAX_SKEW_NORM * 1.02).all()
    assert norm_cap.skew_norm_scale(q, 0) is None  # the exact transform is never capped


@pytest.mark.parametrize("block", [16, 64, 256])
def test_the_spectral_norm_bounds_bracket_the_svd(block):
    norm_cap = importlib.import_module("poet_hf.orthogonal.norm_cap")
    from poet_hf.orthogonal import num_skew_params, skew_from_vector

    generator = torch.Generator().manual_seed(block)
    q = skew_from_vector(torch.randn(8, num_skew_params(block), dtype=torch.float64, generator=generator), block)
    q[:4] = q[:4] @ torch.diag(torch.linspace(1, 0, block, dtype=torch.float64)) ** 3  # decaying spectra
    q[:4] = q[:4] - q[:4].mT
    exact = torch.linalg.matrix_norm(q, ord=2)  # float64 SVD, the independent reference
    lower, upper = norm_cap.skew_spectral_norm_bounds(q)
    assert (lower <= exact * (1 + 1e-12)).all() and (upper >= exact * (1 - 1e-12)).all()
    assert (lower >= 0.98 * exact).all()
    _, coarse_upper = norm_cap.skew_spectral_norm_bounds(q, 2)
    assert (coarse_upper >= exact * (1 - 1e-12)).all() and (coarse_upper <= exact * block**0.125).all()


def test_the_cap_warns_once_per_model(caplog):
    def warnings_logged() -> int:
        return sum("MAX_SKEW_NORM" in r.getMessage() for r in caplog.records)

    with caplog.at_level("WARNING"):
        _three_large_steps(PoetConfig(block_size=8, target_modules=["a", "b"]))  # two layers capped, three steps
        assert warnings_logged() == 1
        _three_large_steps(PoetConfig(block_size=8, target_modules=["a", "b"]))  # another model: its own line
    assert warnings_logged() == 2


# --- 4. two adapters are independent ----------------------------------------------------------------------------------
@pytest.mark.parametrize("tuner", TUNERS)
def test_two_adapters_with_one_config_differ_and_each_name_reproduces(tuner):
    def state(name_pairs):
        model = get_peft_model(tiny_llama(), TUNERS[tuner](init_weights=False), adapter_name=name_pairs[0])
        model.add_adapter(name_pairs[1], TUNERS[tuner](init_weights=False))
        model.base_model.set_adapter(list(name_pairs))  # every adapter's parameters trainable
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        return {
            k: v.clone()
            for k, v in model.state_dict().items()
            if "base_layer" not in k and any(f".{n}" in k for n in name_pairs)
        }, trainable

    first, trainable = state(["default", "other"])
    again, _ = state(["default", "other"])
    for key, value in first.items():
        assert torch.equal(value, again[key]), key  # the same names reproduce
    pairs = [(k, k.replace(".default", ".other")) for k in first if ".default" in k]
    parameters = [(a, b) for a, b in pairs if a in trainable]
    assert parameters and all(not torch.equal(first[a], first[b]) for a, b in parameters)
    if tuner != "orthogonal":
        permutations = [(a, b) for a, b in pairs if "_index" in a and first[a].numel() > 0]
        assert all(not torch.equal(first[a], first[b]) for a, b in permutations)
