"""The POET paper's recipe: the Cayley–Neumann term count against eq. 6, the presets against Tables 2 and 7–9 and
appendix E, configurations the paper uses (per-side budgets, absolute FS sizes, unpacked documents), and its
diagnostics against dense references."""

import importlib.util
import io
import json
import re
from contextlib import redirect_stdout
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from models import tiny_llama
from peft import get_peft_model
from reference import block_rotation_dense, neumann_series, skew_dense, subset_rotation_dense
from script_modules import command_line_error, load_module

import poet_hf  # noqa: F401
from poet_hf import PoetConfig
from poet_hf.diagnostics import _probe_vector, paper_metrics, poet_statistics, rotation_stats
from poet_hf.orthogonal import cayley_neumann, num_skew_params, orthogonal_from_vector, skew_from_vector
from poet_hf.orthogonal.cayley import paper_neumann_k
from poet_hf.orthogonal.norm_cap import MAX_SKEW_NORM
from poet_hf.recipes.pretrain import (
    PretrainArguments,
    parse_pretrain_arguments,
    recipe_parameter_counts,
    resolve_recipe,
)
from poet_hf.tuners.rotation.layer import rotation_layers

ROOT = Path(__file__).resolve().parent.parent


def print_recipe(*flags: str) -> dict:
    module = load_module(ROOT / "scripts" / "pretrain.py")
    out = io.StringIO()
    with redirect_stdout(out):
        module.main([*flags, "--print_recipe"])
    return json.loads(out.getvalue())


# --- 1. Cayley–Neumann terms ----------------------------------------------------------------------------------------
def eq6(q: torch.Tensor, k: int) -> torch.Tensor:
    """The paper's eq. 6 as printed: (I + Q)(I + Σ_{i=1..k} Q^i), by explicit powers in float64."""
    eye = torch.eye(q.shape[-1], dtype=torch.float64)
    total, power = eye.clone(), eye.clone()
    for _ in range(k):
        power = power @ q
        total = total + power
    return (eye + q) @ total


@pytest.mark.parametrize("terms", [3, 4, 5, 6, 7, 8])
def test_neumann_terms_are_pefts_count_and_the_papers_k_is_two_less(terms):
    vec = torch.randn(num_skew_params(6), dtype=torch.float64, generator=torch.Generator().manual_seed(terms)) * 0.1
    q = skew_from_vector(vec, 6)
    expected = eq6(q, paper_neumann_k(terms))
    torch.testing.assert_close(cayley_neumann(q, terms), expected, rtol=0, atol=1e-14)
    torch.testing.assert_close(orthogonal_from_vector(vec[None], 6, terms)[0], expected, rtol=0, atol=1e-14)
    assert not torch.allclose(cayley_neumann(q, terms), eq6(q, terms), atol=1e-6)  # k = n would be another map


def test_the_default_is_the_papers_k_4_and_the_error_speaks_both_conventions():
    assert PoetConfig().neumann_terms == 6 and paper_neumann_k(6) == 4
    assert PoetConfig().merge_every == 400  # §5.2
    with pytest.raises(ValueError, match=r"k = n − 2.*k = 4 is neumann_terms=6.*k = 1 is neumann_terms=3"):
        PoetConfig(neumann_terms=1)


# --- 2. presets -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "preset,lr,paper_steps",
    [
        ("llama-60m", 1e-2, 300_000),
        ("llama-130m", 5e-3, 400_000),
        ("llama-350m", 5e-3, 400_000),
        ("llama-1.3b", 1e-3, 500_000),
    ],
)
def test_a_preset_alone_is_the_papers_run_but_for_its_length(preset, lr, paper_steps):
    recipe = print_recipe("--preset", preset)
    assert recipe["merge_every"] == 400 and recipe["max_grad_norm"] == 0.1 and recipe["weight_decay"] == 0.01
    assert recipe["sequences_per_step"] == 512 and recipe["batch_size"] * recipe["gradient_accumulation_steps"] == 512
    assert recipe["learning_rate"] == lr and recipe["poet_learning_rate"] == 1e-3  # BS-256
    assert recipe["neumann_terms"] == 6 and recipe["paper_neumann_k"] == 4 and recipe["base_init"] == "normalized"
    assert recipe["schedule"] == "cosine_with_min_lr" and recipe["min_lr_ratio"] == 0.01
    assert recipe["warmup_steps"] == 0 and recipe["optimizer"] == "adamw_torch_fused"  # transformers' default
    assert recipe["tokens_per_step"] == 512 * 256
    paper = print_recipe("--preset", preset, "--paper_steps")
    assert paper["steps"] == paper_steps and paper["total_tokens"] == paper_steps * 512 * 256


@pytest.mark.parametrize(
    "flags,optimizer,schedule,fused",
    [
        (["--optim", "adamw_bnb_8bit"], "adamw_bnb_8bit", "cosine_with_min_lr", False),
        pytest.param(
            ["--method", "galore"],
            "galore_adamw",
            "cosine_with_min_lr",
            False,
            marks=pytest.mark.skipif(not importlib.util.find_spec("galore_torch"), reason="the [bench] extra"),
        ),
        (["--lr_scheduler_type", "linear", "--fused_optimizer_step"], "adamw_torch_fused", "linear", True),
    ],
)
def test_the_recipe_reports_the_optimizer_and_schedule_that_run(flags, optimizer, schedule, fused):
    """``--print_recipe`` (and ``results.json``) name the optimizer and schedule the Trainer builds, not fixed text."""
    from transformers import Trainer

    from poet_hf.recipes.pretrain import parse_pretrain_arguments

    recipe = print_recipe("--preset", "tiny", *flags)
    assert (recipe["optimizer"], recipe["schedule"], recipe["fused_optimizer_step"]) == (optimizer, schedule, fused)
    _, training = parse_pretrain_arguments(["--preset", "tiny", *flags])
    assert training.optim == optimizer and training.lr_scheduler_type == schedule  # what Trainer reads
    if optimizer == "adamw_bnb_8bit":
        optimizer_cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(training)
        assert optimizer_cls.__module__.startswith("bitsandbytes") and kwargs["optim_bits"] == 8


@pytest.mark.parametrize(
    "flags,expected",
    [
        (["--block_size", "256"], 1e-3),
        (["--block_size", "128"], 2e-3),
        (["--block_size", "64"], 4e-3),
        (["--method", "poet-fs", "--budget", "0.5"], 1e-3),
        (["--method", "poet-fs", "--budget", "0.25"], 2e-3),
        (["--method", "poet-fs", "--budget", "0.125"], 4e-3),
    ],
)
def test_the_poet_learning_rate_is_tied_to_the_rotation_size_as_tables_8_and_9(flags, expected):
    assert print_recipe("--preset", "llama-60m", *flags)["poet_learning_rate"] == pytest.approx(expected)


def test_flags_override_every_recipe_value():
    recipe = print_recipe(
        "--preset",
        "llama-130m",
        "--merge_every",
        "200",
        "--max_grad_norm",
        "1.0",
        "--weight_decay",
        "0",
        "--learning_rate",
        "3e-3",
        "--poet_learning_rate",
        "5e-4",
        "--per_device_train_batch_size",
        "16",
        "--global_batch_size",
        "256",
        "--neumann_terms",
        "5",
        "--max_steps",
        "77",
    )
    assert (recipe["merge_every"], recipe["max_grad_norm"], recipe["weight_decay"]) == (200, 1.0, 0.0)
    assert (recipe["learning_rate"], recipe["poet_learning_rate"], recipe["neumann_terms"]) == (3e-3, 5e-4, 5)
    assert (recipe["batch_size"], recipe["gradient_accumulation_steps"], recipe["steps"]) == (16, 16, 77)
    two_processes = resolve_recipe(PretrainArguments(preset="llama-130m"), world_size=2)
    assert two_processes.batch_size * two_processes.gradient_accumulation_steps * 2 == 512


# --- Table 2: every cell the paper's numbers determine -------------------------------------------------------------
TABLE_2 = {  # trainable parameters of the blocks' Linear layers, in millions
    ("llama-60m", "poet-bs"): {64: 2.39, 128: 4.81, 256: 9.66},
    ("llama-60m", "poet-fs"): {0.125: 0.53, 0.25: 2.13, 0.5: 8.54},
    ("llama-130m", "poet-bs"): {64: 5.52, 128: 11.12, 256: 22.33},
    ("llama-130m", "poet-fs"): {0.125: 1.78, 0.25: 7.13, 0.5: 28.56},
    ("llama-350m", "poet-bs"): {64: 14.90, 128: 30.04, 256: 60.32},
    ("llama-350m", "poet-fs"): {0.125: 6.34, 0.25: 25.44, 0.5: 101.86},
    # 1.3B BS-256's 118.26M fits no FFN divisible by 256 (Table 7's 5376 gives 118.29M), so it is not checked.
    ("llama-1.3b", "poet-bs"): {64: 29.22, 128: 58.91},
    ("llama-1.3b", "poet-fs"): {0.125: 25.39, 0.25: 101.66, 0.5: 406.88},
}
CELLS = [(p, m, size, value) for (p, m), row in TABLE_2.items() for size, value in row.items()]


def counted(args: PretrainArguments, vocab_size: int):
    """The recipe of ``args`` with what its method trains counted (as ``--print_recipe`` counts it)."""
    recipe = resolve_recipe(args, vocab_size=vocab_size)
    return replace(recipe, parameters=recipe_parameter_counts(recipe, vocab_size))


@pytest.mark.parametrize("preset,method,size,millions", CELLS)
def test_every_determined_table_2_count_is_reproduced(preset, method, size, millions):
    flag = "--block_size" if method == "poet-bs" else "--budget"
    recipe = counted(PretrainArguments(preset=preset, method=method, **{flag[2:]: size}), vocab_size=32000)
    assert recipe.parameters is not None
    assert abs(recipe.parameters["trainable_block_params"] / 1e6 - millions) <= 0.005 + 1e-9


def test_the_llama_2_7b_preset_has_the_checkpoints_shape_and_table_1s_block_count():
    """Llama-2-7B's shape (configs/models/llama-2-7b.json) and POET-BS-256's skew count by Table 1: each side of an
    ``m × n`` weight has ``dim/b`` blocks of ``b(b−1)/2`` entries (11008 = 43·256)."""
    config = json.loads((ROOT / "configs" / "models" / "llama-2-7b.json").read_text())
    recipe = counted(PretrainArguments(preset="llama-2-7b"), vocab_size=config["vocab_size"]).as_dict()
    model = recipe["model"]
    assert (model["hidden"], model["intermediate"], model["heads"], model["layers"]) == (
        config["hidden_size"],
        config["intermediate_size"],
        config["num_attention_heads"],
        config["num_hidden_layers"],
    )
    hidden, ffn, b = 4096, 11008, 256
    blocks = 4 * (hidden // b + hidden // b) + 3 * (hidden // b + ffn // b)
    assert recipe["trainable_block_params"] == 32 * blocks * b * (b - 1) // 2


# --- 3. configurations the paper uses --------------------------------------------------------------------------------
def test_per_side_budgets_count_as_their_sides_and_symmetric_ones_as_table_2():
    recipe = counted(
        PretrainArguments(preset="llama-60m", method="poet-fs", budget_input=0.75, budget_output=0.25), vocab_size=32000
    ).as_dict()
    hidden, ffn, layers = 512, 1376, 8
    shapes = [(hidden, hidden)] * 4 + [(hidden, ffn)] * 2 + [(ffn, hidden)]
    expected = layers * sum(
        -(-3 * d_in // 4) * (-(-3 * d_in // 4) - 1) // 2 + -(-d_out // 4) * (-(-d_out // 4) - 1) // 2
        for d_in, d_out in shapes
    )
    assert recipe["trainable_block_params"] == expected
    assert recipe["budget"] == {"input": 0.75, "output": 0.25}


def test_fully_stochastic_sides_take_an_absolute_size_and_per_side_block_sizes_work():
    model = get_peft_model(tiny_llama(), PoetConfig(spo="full", budget={"input": 24, "output": 0.25}))
    for name, layer in rotation_layers(model):
        specs = layer.rotation_specs["default"]
        assert specs["input"].block == 24 and specs["output"].block == -(-layer.out_features // 4), name
    model = get_peft_model(tiny_llama(), PoetConfig(block_size={"input": 32, "output": 16}))
    layer = rotation_layers(model)[0][1]
    assert (
        layer.rotation_specs["default"]["input"].block == 32 and layer.rotation_specs["default"]["output"].block == 16
    )
    with pytest.raises(ValueError, match=r"`budget\['input'\]`"):
        PoetConfig(spo="full", budget={"input": 1.5})


def test_unpacked_documents_are_truncated_or_padded_and_padding_never_counts(tmp_path):
    from datasets import Dataset

    from poet_hf.data import load_tokenizer, pad_documents
    from poet_hf.recipes.pretrain import run_pretraining

    tokenizer = load_tokenizer(None)
    docs = ["To be, or not to be.", "All the world's a stage, and all the men and women merely players. " * 8]
    rows = pad_documents(Dataset.from_dict({"text": docs}), tokenizer, seq_len=32)
    lengths = [len(tokenizer(d, add_special_tokens=False)["input_ids"]) for d in docs]
    assert [sum(r) for r in rows["attention_mask"]] == [min(n, 32) for n in lengths]
    assert all(
        label == -100 for label, keep in zip(rows["labels"][0], rows["attention_mask"][0], strict=True) if not keep
    )
    corpus = tmp_path / "short.jsonl"
    lines = [" ".join(["Speak the speech, I pray you."] * (1 + i % 5)) for i in range(60)]
    corpus.write_text("".join(json.dumps({"text": line}) + "\n" for line in lines))
    results = run_pretraining(
        *parse_pretrain_arguments(
            packing=False,
            dataset=str(corpus),
            seq_len=64,
            max_steps=3,
            per_device_train_batch_size=2,
            global_batch_size=2,
            max_eval_samples=2,
            output_dir=str(tmp_path / "run"),
            logging_steps=1,
        )
    )
    assert 0 < results["tokens_seen"] < 3 * 2 * 64  # only real tokens were counted
    assert results["recipe"]["packing"] is False and results["recipe"]["steps"] == 3


# --- 4. the paper's diagnostics --------------------------------------------------------------------------------------
def dense_rotation(layer, side: str, blocks: torch.Tensor, spo: str) -> torch.Tensor:
    """One side's whole ``m × m`` rotation from its float64 blocks and its permutation / index set (eqs. 4–5)."""
    index, dim = layer.index_buffer("default", side), layer.rotation_specs["default"][side].dim
    return subset_rotation_dense(index, blocks[0], dim) if spo == "full" else block_rotation_dense(index, blocks)


@pytest.mark.parametrize("spo", ["block", "full"])
def test_e_orth_and_the_trace_metric_are_those_of_the_whole_dense_rotation(spo):
    model = get_peft_model(tiny_llama(), PoetConfig(spo=spo, block_size=16, neumann_terms=3, init_weights=False))
    for _, layer in rotation_layers(model)[:4]:
        with torch.no_grad():
            for side in layer.rotation_specs["default"]:
                layer.rotation_parameter("default", side).mul_(4)  # a visibly inexact truncated series
        metrics = paper_metrics(layer)
        for side, spec in layer.rotation_specs["default"].items():
            blocks = torch.stack(
                [
                    cayley_neumann(skew_from_vector(row.double(), spec.block), 3)
                    for row in layer.rotation_parameter("default", side).detach()
                ]
            )
            dense = dense_rotation(layer, side, blocks, spo)
            eye = torch.eye(spec.dim, dtype=torch.float64)
            e_orth = float(torch.linalg.matrix_norm(dense @ dense.T - eye) / torch.linalg.matrix_norm(eye))
            assert metrics[side]["e_orth"] == pytest.approx(e_orth, rel=1e-10) and e_orth > 1e-4
            assert metrics[side]["trace"] == pytest.approx(float(torch.trace(dense)) / spec.dim, rel=1e-12)


@pytest.mark.parametrize("spo", ["block", "full"])
def test_logged_statistics_are_those_of_the_dense_rotations(spo):
    """What PoetTrainer logs (`poet_statistics`) and a merge records (`rotation_stats`), from one float64 evaluation
    of each side's blocks, against loop-built skew matrices, explicit Neumann powers and dense rotations: the
    largest ``||Q||_2`` and block error, the bound from the singular values of the materialized blocks, the layer
    means of e_orth and of the probe cosine ``vᵀ R v``. float64 rounding of 16 × 16 products is about 1e-14."""
    terms = 3
    model = get_peft_model(tiny_llama(), PoetConfig(spo=spo, block_size=16, neumann_terms=terms, init_weights=False))
    layers = rotation_layers(model)
    with torch.no_grad():
        for _, layer in layers:
            for side in layer.rotation_specs["default"]:
                layer.rotation_parameter("default", side).mul_(4)  # a visibly inexact truncated series
    q_norm, block_error, probe, e_orth = 0.0, 0.0, {"R": [], "P": []}, {"R": [], "P": []}
    for _, layer in layers:
        bound = 1.0
        for side, spec in layer.rotation_specs["default"].items():
            qs = [skew_dense(row.double(), spec.block) for row in layer.rotation_parameter("default", side).detach()]
            blocks = torch.stack([neumann_series(q, terms) for q in qs])
            q_norm = max(q_norm, max(float(torch.linalg.svdvals(q).max()) for q in qs))
            eye_b = torch.eye(spec.block, dtype=torch.float64)
            errors = torch.linalg.matrix_norm(blocks @ blocks.mT - eye_b) / spec.block**0.5
            block_error = max(block_error, float(errors.max()))
            bound *= 1 + float((torch.linalg.svdvals(blocks) - 1).abs().max())
            dense = dense_rotation(layer, side, blocks, spo)
            eye = torch.eye(spec.dim, dtype=torch.float64)
            letter = "R" if side == "input" else "P"
            e_orth[letter].append(float(torch.linalg.matrix_norm(dense @ dense.T - eye) / spec.dim**0.5))
            v = _probe_vector(layer, "default", side, spec.dim)
            probe[letter].append(float(v @ dense @ v))
        assert rotation_stats(layer)["neumann_bound"] == pytest.approx(bound - 1, rel=1e-10)
        assert bound - 1 > 1e-3
    stats = poet_statistics(model)
    assert stats["poet/q_norm"] == pytest.approx(q_norm, rel=1e-12) and q_norm < MAX_SKEW_NORM  # no rescaling
    assert stats["poet/block_orth_error"] == pytest.approx(block_error, rel=1e-10)
    for letter in "RP":
        assert stats[f"poet/e_orth_{letter}"] == pytest.approx(sum(e_orth[letter]) / len(layers), rel=1e-10)
        assert stats[f"poet/probe_cos_{letter}"] == pytest.approx(sum(probe[letter]) / len(layers), rel=1e-12)
        assert stats[f"poet/probe_cos_{letter}"] < 1 - 1e-4  # the probes see the rotations


def test_exact_cayley_rotations_have_zero_e_orth():
    model = get_peft_model(tiny_llama(), PoetConfig(block_size=16, neumann_terms=0, init_weights=False))
    for _, layer in rotation_layers(model):
        assert max(m["e_orth"] for m in paper_metrics(layer).values()) < 1e-13


@pytest.mark.parametrize(
    "flags",
    [["--steps", "paper"], ["--batch_size", "16"], ["--max_eval_sequences", "7"], ["--tokenizer", "gpt2"]],
    ids=lambda flags: flags[0],
)
def test_the_former_spellings_are_refused(flags):
    """One spelling per option (0.1.0 was never published): the former ones are unknown flags, not aliases."""
    with pytest.raises(SystemExit):
        parse_pretrain_arguments([*flags, "--output_dir", "unused"])


def test_pretrain_method_poet_is_refused_in_one_line_naming_the_methods(capsys):
    error = command_line_error(capsys, lambda: parse_pretrain_arguments(["--method", "poet", "--output_dir", "unused"]))
    assert re.search(r"error: --method must be one of .*'poet-bs'.*got 'poet'$", error.strip()), error
    with pytest.raises(ValueError, match="`method` must be one of .*poet-bs"):  # a Python caller gets the exception
        parse_pretrain_arguments(method="poet", output_dir="unused")


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--block_size", "-5"], "--block_size must be an integer >= 2, got -5"),
        (["--merge_every", "0"], "--merge_every must be an integer >= 1, got 0"),
        (["--bf16", "maybe"], "argument --bf16: Truthy value expected"),  # argparse's own, without its usage block
        (["--no_such_flag", "1"], "unrecognized arguments: --no_such_flag 1"),
        (["--max_steps", "ten"], "argument --max_steps/--max-steps: invalid int value: 'ten'"),
    ],
)
def test_an_invalid_value_is_one_line_naming_the_flag_and_exit_status_2(capsys, flags, message):
    assert message in command_line_error(capsys, lambda: parse_pretrain_arguments([*flags, "--output_dir", "unused"]))


def test_presets_stay_hashable_with_the_adapter_fields_they_set():
    from poet_hf.recipes.presets import PRESETS

    assert len({preset: name for name, preset in PRESETS.items()}) == len(PRESETS)  # frozen and hashable
    assert PRESETS["tiny"].adapter_fields == {"merge_every": 50, "block_size": 32}
    assert PRESETS["tiny"].block_size == 32
    assert PRESETS["llama-60m"].adapter_fields == {}  # PoetConfig's merge_every, 400, and block_size, 256
    assert PRESETS["llama-60m"].block_size == 256


@pytest.mark.parametrize("method", ["poet-bs", "poet-fs", "lora", "adamw"])
def test_the_printed_recipe_is_the_typed_one_flat_with_the_methods_own_settings(method):
    recipe = resolve_recipe(PretrainArguments(preset="tiny", method=method))
    printed = print_recipe("--preset", "tiny", "--method", method)  # with the parameter counts beside it
    flat = json.loads(json.dumps(recipe.as_dict()))
    flat["model"]["vocab"] = printed["model"]["vocab"]  # the run's tokenizer's (resolved here without one)
    assert {key: printed[key] for key in flat} == flat and "trainable_params" in printed
    assert ("block_size" in printed, "budget" in printed) == (method == "poet-bs", method == "poet-fs")
    assert ("spo" in printed, "lora_rank" in printed) == (method.startswith("poet"), method == "lora")
    if recipe.rotation is not None:
        assert printed["spo"] == recipe.rotation.config.spo == ("block" if method == "poet-bs" else "full")
        assert printed["neumann_terms"] - printed["paper_neumann_k"] == 2
    assert printed["tokens_per_step"] == recipe.sequences_per_step * recipe.model["seq_len"]


@pytest.mark.parametrize("method", ["adamw", "lora", "poet-bs"])
def test_a_plan_of_any_method_reads_the_typed_recipe(method):
    """The plan of a method without rotations raised ``KeyError: 'cache_rotations'`` while the recipe was a
    dict; the plan now takes each method's settings from the typed recipe (the tiny preset: micro-batch 8, 1 process,
    block 32)."""
    from poet_hf.recipes.run_plan import plan_pretraining, plan_settings

    args, training = parse_pretrain_arguments(["--preset", "tiny", "--method", method, "--lora_rank", "16"])
    settings = plan_settings(args, training)
    assert (settings.method, settings.batch_size, settings.processes) == (method, 8, 1)
    assert settings.cache_rotations == "auto"
    block_size = plan_pretraining(args, training)[0].settings["block_size"]  # the plan's, from the recipe
    assert (block_size == 32, settings.rank == 16) == (method == "poet-bs", method == "lora")
