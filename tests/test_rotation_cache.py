"""Rotations built once per optimizer step across micro-batches (``poet_hf.tuners.rotation.caches``).

Gradients of ``k`` accumulated micro-batches, every one but the last deferring its rotation gradients, are checked
against the plain-autograd float64 reference (explicit Cayley–Neumann powers, autograd through them); the cache's
lifetime (the last backward, an optimizer step, ``zero_grad``, an exception, ``eval()``); Trainer's accumulation;
and 2-process DDP and FSDP2 (tests/workers/accumulation_worker.py).
"""

import contextlib
import json
from pathlib import Path

import prewarmed
import pytest
import torch
from models import tiny_gpt2
from peft import get_peft_model
from tolerances import gamma, tiny_model_tolerance

import poet_hf  # noqa: F401
from poet_hf import OftConfig, PoetConfig, defer_rotation_grads, merge_and_reinit
from poet_hf.orthogonal.rotated_linear import SideRotation
from poet_hf.tuners.rotation.caches import DeferredStepWarning
from poet_hf.tuners.rotation.layer import rotation_layers
from poet_hf.tuners.rotation.model import plain_autograd

HERE = Path(__file__).resolve().parent


TARGETS = ["c_attn", "c_proj", "c_fc"]


def build(tuner: str = "poet", spo: str = "block", forward: str = "auto", **fields):
    """A float64 GPT-2 (LLaMA's RMSNorm computes in float32 whatever the model's dtype, which would cap every float64
    comparison at float32 rounding) without dropout, with random rotations."""
    config = (
        PoetConfig(
            spo=spo, block_size=16, budget=0.5, init_weights=False, forward=forward, target_modules=TARGETS, **fields
        )
        if tuner == "poet"
        else OftConfig(block_size=16, init_weights=False, forward=forward, target_modules=TARGETS, **fields)
    )
    model = tiny_gpt2().double()
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return get_peft_model(model, config)


def batches(k: int, seed: int = 1) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (2, 8), generator=generator) for _ in range(k)]  # GPT-2's vocabulary: 128


def backward(model, ids: torch.Tensor, defer: bool = False) -> None:
    with defer_rotation_grads() if defer else contextlib.nullcontext():
        model(input_ids=ids, labels=ids).loss.backward()


def accumulate(model, micro_batches: list[torch.Tensor]) -> None:
    """A plain loop: every micro-batch but the last deferred."""
    for i, ids in enumerate(micro_batches):
        backward(model, ids, defer=i < len(micro_batches) - 1)


def reference_grads(model_factory, steps) -> dict[str, torch.Tensor]:
    """Plain autograd, no deferral: ``steps`` is a list of callables run on the model in order."""
    model = model_factory()
    with plain_autograd(model):
        for step in steps:
            step(model)
    return grads_of(model)


def grads_of(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}


def assert_grads_equal(actual: dict, expected: dict, terms: int) -> None:
    """Two float64 evaluations of the same gradient, each within γ_N of exact (plus ``terms`` accumulated sums)."""
    assert actual.keys() == expected.keys()
    tolerance = tiny_model_tolerance(torch.float64, backward=True) + gamma(terms, torch.float64)
    for name, value in expected.items():
        error = float((actual[name] - value).abs().max() / value.abs().max())
        assert error <= tolerance, (name, error, tolerance)


def cache_bytes(model) -> int:
    return sum(layer.rotation_cache_bytes() for _, layer in rotation_layers(model))


def skew_grads_nonzero(model) -> bool:
    return all(
        p.grad is not None and bool(p.grad.abs().sum() > 0)
        for n, p in model.named_parameters()
        if "poet_" in n and p.requires_grad
    )


@pytest.fixture
def count_polynomials(monkeypatch):
    """How many times the Cayley–Neumann polynomial is evaluated (forward, rebuild or flush)."""
    calls = {"n": 0}
    evaluate = SideRotation._evaluate

    def counting(self, vec):
        calls["n"] += 1
        return evaluate(self, vec)

    monkeypatch.setattr(SideRotation, "_evaluate", counting)
    return calls


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize(
    "tuner,spo,forward",
    [("poet", "block", "weight"), ("poet", "block", "activation"), ("poet", "full", "auto"), ("oft", "block", "auto")],
)
def test_accumulated_gradients_equal_the_float64_reference(tuner, spo, forward, k):
    micro_batches = batches(k)
    expected = reference_grads(
        lambda: build(tuner, spo, forward), [lambda m, ids=ids: backward(m, ids) for ids in micro_batches]
    )
    model = build(tuner, spo, forward)
    accumulate(model, micro_batches)
    assert_grads_equal(grads_of(model), expected, k)
    assert skew_grads_nonzero(model)
    assert cache_bytes(model) == 0  # the last backward empties every cache


def test_the_polynomial_runs_twice_per_optimizer_step_whatever_the_accumulation(count_polynomials):
    """Without deferral each micro-batch evaluates the polynomial twice per side (forward, and the backward's
    rebuild for its VJP); with it, the step's first forward builds it and the last backward rebuilds it once."""
    model = build()
    sides = sum(len(layer.rotation_specs["default"]) for _, layer in rotation_layers(model))
    for ids in batches(4):
        backward(model, ids)
    assert count_polynomials["n"] == 2 * 4 * sides
    count_polynomials["n"] = 0
    accumulate(model, batches(4))
    assert count_polynomials["n"] == 2 * sides


def test_the_cache_holds_the_blocks_and_their_gradient_and_nothing_more():
    """While deferred: per side the ``rows × b × b`` blocks and the pending ``∂L/∂blocks`` of the same size."""
    model = build()
    backward(model, batches(1)[0], defer=True)
    expected = sum(
        2 * 8 * layer.rotation_parameter("default", side).shape[0] * spec.block**2
        for _, layer in rotation_layers(model)
        for side, spec in layer.rotation_specs["default"].items()
    )
    assert cache_bytes(model) == expected


def test_a_merge_inside_the_accumulation_window_keeps_the_gradients_exact():
    """A merge between micro-batches applies the deferred gradients against the rotations it folds, as the
    micro-batches would have without deferral."""
    first, second, third = batches(3)
    expected = reference_grads(
        build,
        [
            lambda m: backward(m, first),
            lambda m: merge_and_reinit(m),
            lambda m: backward(m, second),
            lambda m: backward(m, third),
        ],
    )
    model = build()
    backward(model, first, defer=True)
    merge_and_reinit(model)
    backward(model, second, defer=True)
    backward(model, third)
    assert_grads_equal(grads_of(model), expected, 3)
    assert cache_bytes(model) == 0


def test_an_optimizer_step_before_the_last_micro_batch_applies_the_deferred_gradients():
    first = batches(1)[0]
    model = build()
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
    accumulate(model, batches(2, seed=5))  # a first, complete window (lr 0: the parameters stay as built)
    optimizer.step()
    optimizer.zero_grad()
    backward(model, first, defer=True)
    assert cache_bytes(model) > 0
    seen = {}
    optimizer.register_step_pre_hook(lambda *args: seen.update(grads_of(model)))
    with pytest.warns(DeferredStepWarning, match="unreduced across processes"):
        optimizer.step()
    assert cache_bytes(model) == 0
    assert_grads_equal(seen, reference_grads(build, [lambda m: backward(m, first)]), 1)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad_drops_the_deferred_gradients_with_the_rest(set_to_none):
    first, second, third = batches(3)
    model = build()
    backward(model, first, defer=True)
    backward(model, second, defer=True)
    model.zero_grad(set_to_none=set_to_none)
    if set_to_none:  # released with the gradient it belongs to
        assert cache_bytes(model) == 0
    backward(model, third)
    assert cache_bytes(model) == 0
    assert_grads_equal(grads_of(model), reference_grads(build, [lambda m: backward(m, third)]), 1)


@pytest.mark.parametrize("task_type", [None, "CAUSAL_LM"])  # PEFT reaches the wrapped model two ways
def test_an_exception_in_a_micro_batch_frees_the_cache_and_keeps_the_earlier_gradients(task_type):
    first, second = batches(2)
    model = build(task_type=task_type)
    backward(model, first, defer=True)
    layer = rotation_layers(model)[3][1]
    handle = layer.register_forward_hook(lambda *args: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        backward(model, second, defer=True)
    handle.remove()
    assert cache_bytes(model) == 0
    assert_grads_equal(grads_of(model), reference_grads(build, [lambda m: backward(m, first)]), 1)


def test_eval_between_micro_batches_frees_the_cache_and_the_window_goes_on():
    first, second = batches(2)
    model = build()
    backward(model, first, defer=True)
    model.eval()
    assert cache_bytes(model) == 0
    with torch.no_grad():
        model(input_ids=second)
    model.train()
    backward(model, second)
    expected = reference_grads(build, [lambda m: backward(m, first), lambda m: backward(m, second)])
    assert_grads_equal(grads_of(model), expected, 2)


def test_changing_a_skew_parameter_by_hand_under_deferred_gradients_is_refused():
    first, second = batches(2)
    model = build()
    backward(model, first, defer=True)
    with torch.no_grad():
        next(p for n, p in model.named_parameters() if "poet_R" in n).mul_(2)
    with pytest.raises(RuntimeError, match="changed while its gradient was deferred.*flush_rotation_caches"):
        backward(model, second)
    poet_hf.flush_rotation_caches(model)
    assert cache_bytes(model) == 0


def test_trainer_accumulation_defers_and_gives_the_undeferred_gradients(tmp_path, monkeypatch, count_polynomials):
    """PoetTrainer with gradient_accumulation_steps=4 (accelerate's ``sync_gradients`` tells the layers which
    micro-batch is last): the polynomial runs twice per side per optimizer step instead of eight times, and the first
    step's clipped gradients equal those of the same run with deferral switched off, to float32 rounding."""
    from training_utils import tiny_dataset, tiny_poet_model, tiny_trainer
    from transformers import TrainerCallback

    from poet_hf.tuners.rotation import caches as rotation_cache

    dataset, tokenizer = tiny_dataset()

    class FirstStepGrads(TrainerCallback):
        def __init__(self, model):
            self.model, self.grads = model, None

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            self.grads = self.grads or grads_of(self.model)

    def train(defer: bool) -> dict[str, torch.Tensor]:
        with monkeypatch.context() as patch:
            if not defer:
                patch.setattr(rotation_cache, "deferring", lambda: False)
            model = tiny_poet_model(len(tokenizer))
            trainer = tiny_trainer(
                tmp_path / str(defer),
                model,
                dataset,
                per_device_train_batch_size=2,
                gradient_accumulation_steps=4,
                max_steps=2,
                max_grad_norm=0.5,
            )
            capture = FirstStepGrads(model)
            trainer.add_callback(capture)
            trainer.train()
        assert cache_bytes(model) == 0
        return capture.grads

    undeferred = train(defer=False)
    undeferred_calls, count_polynomials["n"] = count_polynomials["n"], 0
    deferred = train(defer=True)
    assert count_polynomials["n"] * 4 == undeferred_calls
    tolerance = tiny_model_tolerance(torch.float32, backward=True) + gamma(4, torch.float32)
    for name, value in undeferred.items():
        assert float((deferred[name] - value).abs().max() / value.abs().max()) <= tolerance, name


@pytest.mark.slow
def test_ddp_and_fsdp2_accumulation_equals_the_single_process_reference(tmp_path):
    """2 processes (gloo): DDP with ``no_sync`` and FSDP2 with ``set_requires_gradient_sync(False)`` on the first k − 1
    micro-batches, k = 1, 2, 4, and a merge inside the window (tests/workers/accumulation_worker.py), each with the
    cache on and ``"auto"``.

    ``"auto"`` caches under DDP (the polynomial is most of this tiny model's work, and the cache holds b/(b−1) times
    the rotations' state) and not under FSDP2 (2·b/(b−1) times the sharded state, above the 2 allowed): the gradients
    are the reference's either way."""
    prewarmed.run(HERE / "workers" / "accumulation_worker.py", [tmp_path], tmp_path / "worker.log", ranks=2)
    tolerance = tiny_model_tolerance(torch.float64, backward=True) + gamma(8, torch.float64)
    cases = ("k1", "k2", "k4", "merge")
    for rank in (0, 1):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert set(report) == {f"{e}-{cache}-{c}" for e in ("ddp", "fsdp2") for cache in (True, "auto") for c in cases}
        for case, row in report.items():
            caches = not case.endswith("k1") and not case.startswith("fsdp2-auto")  # it deferred, and it caches
            assert row["error"] <= tolerance, (rank, case, row)
            assert row["cache_bytes_left"] == 0, (rank, case, row)
            assert (row["cache_bytes_held"] > 0) == caches, (rank, case, row)
            if "-auto-" in case and not case.endswith("k1"):  # every layer chose alike, and as expected
                assert set(row["chosen"].values()) == {case.startswith("ddp")}, (rank, case, row)
            assert row["tensors"] > 0


def test_the_cost_model_counts_the_polynomial_as_each_micro_batch_pays_it():
    """k = 5 terms: 2 products forward, 3 for the VJP (neumann_product_count). An uncached call pays 2·2 + 3, the
    window's first micro-batch 2, the others none, the last 2 + 3: per optimizer step as much as one uncached call.
    The amount is the same in every strategy, so the choice does not move."""
    from poet_hf.orthogonal import CayleyNeumann, HouseholderProduct
    from poet_hf.orthogonal.spo import SideSpec
    from poet_hf.orthogonal.strategy_costs import polynomial_products, strategy_costs

    block = SideSpec("block", 768, 256)
    per_product = 2 * 3 * 256**3  # two sides of three 256-blocks
    base = strategy_costs(1024, 768, 768, block, block, training=True)
    phases = ("uncached", "building", "deferred", "closing")
    products = {phase: polynomial_products(CayleyNeumann(5), 256, phase) for phase in phases}
    assert products == {"uncached": 7, "building": 2, "deferred": 0, "closing": 5}
    # 256 Householder reflections per 256-block: 2·b²·k = 2 products forward, twice that for autograd's VJP.
    assert polynomial_products(HouseholderProduct(), 256, "uncached") == 2 * 2 + 4
    for count in products.values():
        costs = strategy_costs(1024, 768, 768, block, block, training=True, polynomial=count)
        assert {name: cost["macs"] - base[name]["macs"] for name, cost in costs.items()} == dict.fromkeys(
            base, count * per_product
        )
    layer = rotation_layers(build())[0][1]
    assert {layer.choose_strategy("default", 64, True, phase) for phase in products} == {
        layer.choose_strategy("default", 64, True)
    }


def test_cache_rotations_false_rebuilds_per_micro_batch_and_holds_nothing(count_polynomials):
    micro_batches = batches(4)
    expected = reference_grads(build, [lambda m, ids=ids: backward(m, ids) for ids in micro_batches])
    model = build(cache_rotations=False)
    sides = sum(len(layer.rotation_specs["default"]) for _, layer in rotation_layers(model))
    for i, ids in enumerate(micro_batches):
        backward(model, ids, defer=i < 3)
        assert cache_bytes(model) == 0
    assert count_polynomials["n"] == 2 * 4 * sides
    assert_grads_equal(grads_of(model), expected, 4)
    with pytest.raises(ValueError, match="`cache_rotations` must be 'auto', True or False"):
        PoetConfig(cache_rotations="yes")


def test_the_cache_choice_weighs_the_polynomial_and_the_state_as_counted_by_hand():
    """``rotation_cache_choice`` against the multiply-adds and bytes written out: a 512 × 512 POET-BS 256 layer, six
    terms (3 products forward, 5 for the VJP: 2·3 + 5 per uncached micro-batch), 512 tokens."""
    from poet_hf.orthogonal import CayleyNeumann, HouseholderProduct
    from poet_hf.orthogonal.spo import SideSpec
    from poet_hf.orthogonal.strategy_costs import rotation_cache_choice

    side = SideSpec("block", 512, 256)
    tokens, n = 512, 512 * 512
    polynomial = 11 * 2 * (2 * 256**3)  # both sides, two 256-blocks each
    weight_strategy = 3 * tokens * n + 3 * 256 * n + 4 * 256 * n  # y, ∂x, ∂W; R's and P's rotations of W
    activation_strategy = 2 * tokens * n + 3 * 2 * (256 * tokens * 512)  # two products; three rotations of the rows
    layer = min(weight_strategy, activation_strategy + tokens * n + 256 * tokens * 512)  # the recompute keeps nothing
    cache = 2 * (2 * 256**2) * (4 + 4)  # blocks and pending gradient, float32, both sides
    state = 16 * 2 * (2 * 256 * 255 // 2)  # parameter, gradient, two moments per skew entry
    choice = rotation_cache_choice(tokens, 512, 512, side, side, CayleyNeumann(6))
    assert choice.saving == pytest.approx(polynomial / (layer + polynomial), rel=1e-12)
    assert choice.hold == pytest.approx(cache / state, rel=1e-12) and choice.cache_bytes == cache
    assert choice.cache and choice.reason.startswith("on:")
    sharded = rotation_cache_choice(
        tokens, 512, 512, side, side, CayleyNeumann(6), shards=2
    )  # the state halves, the cache does not
    assert sharded.hold == pytest.approx(2 * cache / state) and not sharded.cache and "above the 2x" in sharded.reason
    long = rotation_cache_choice(
        64 * tokens, 512, 512, side, side, CayleyNeumann(6)
    )  # the layer's products grow, the polynomial not
    assert long.saving < 0.10 and not long.cache and "below 10%" in long.reason
    half = rotation_cache_choice(
        tokens, 512, 512, side, side, CayleyNeumann(6), shards=2, block_bytes=2
    )  # bfloat16 blocks
    assert half.cache_bytes == 2 * (2 * 256**2) * (2 + 4) and half.cache
    # Householder products: 256 vectors of 256 entries per block (16 B of state each), 2 + 4 + 2 + 4 products.
    householder = rotation_cache_choice(tokens, 512, 512, side, side, HouseholderProduct())
    assert householder.hold == pytest.approx(cache / (16 * 2 * (2 * 256 * 256)), rel=1e-12)
    hh_polynomial = 8 * 2 * (2 * 256**3)
    assert householder.saving == pytest.approx(hh_polynomial / (layer + hh_polynomial), rel=1e-12)


def test_auto_decides_once_per_layer_logs_at_the_step_and_keeps_the_gradients(caplog, count_polynomials):
    """A tiny layer at 16 tokens per micro-batch: the polynomial is most of its work, so ``"auto"`` caches (two builds
    per optimizer step); at 512 tokens it is under a tenth and every micro-batch rebuilds. The gradients are the float64
    reference's either way, and the first optimizer step logs the choice."""
    import logging

    sides = sum(len(layer.rotation_specs["default"]) for _, layer in rotation_layers(build()))
    for shape, caches in (((2, 8), True), ((8, 64), False)):
        generator = torch.Generator().manual_seed(3)
        micro_batches = [torch.randint(0, 128, shape, generator=generator) for _ in range(4)]
        expected = reference_grads(build, [lambda m, ids=ids: backward(m, ids) for ids in micro_batches])
        model = build(cache_rotations="auto")
        count_polynomials["n"] = 0
        accumulate(model, micro_batches)
        state = rotation_layers(model)[0][1].step_state
        assert {choice.cache for choice in state.cache_choices.values()} == {caches}
        assert len(state.cache_choices) == len(rotation_layers(model))
        assert count_polynomials["n"] == (2 if caches else 2 * 4) * sides
        assert_grads_equal(grads_of(model), expected, 4)
        with caplog.at_level(logging.INFO, logger="poet_hf.tuners.rotation.caches"):
            caplog.clear()
            torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0).step()
        summary = state.cache_summary()["summary"]
        assert summary.startswith(f"{len(rotation_layers(model)) if caches else 0} of {len(rotation_layers(model))}")
        assert [r.getMessage() for r in caplog.records] == [f"cache_rotations='auto': {summary}"]


def test_under_autocast_the_cache_keeps_the_blocks_in_the_compute_dtype_and_the_forward_is_unchanged():
    """bfloat16 autocast: the calls cast the blocks to bfloat16 anyway, so the cache keeps them so (half the bytes),
    and a deferred micro-batch's output is the uncached forward's, bit for bit."""
    from poet_hf.orthogonal.rotation_sides import RotationCache

    micro_batches = batches(2)
    outputs = {}
    for cache in (True, False):
        model = build(cache_rotations=cache).float()
        with torch.autocast("cpu", dtype=torch.bfloat16), defer_rotation_grads():
            outputs[cache] = [model(input_ids=ids).logits for ids in micro_batches]
        if cache:
            held = [c for _, layer in rotation_layers(model) for c in layer.fused.caches.values()]
            assert held and all(isinstance(c, RotationCache) and c.blocks.dtype == torch.bfloat16 for c in held)
    for cached, rebuilt in zip(outputs[True], outputs[False], strict=True):
        assert torch.equal(cached, rebuilt)
