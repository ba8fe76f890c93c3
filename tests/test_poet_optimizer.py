"""POET's optimizer for any Trainer: `create_poet_optimizer` builds PoetTrainer's groups and rates, and TRL's
`SFTTrainer` fine-tunes the pretrained testbed LM with it."""

from __future__ import annotations

import json

import pytest
import torch
from peft import get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

import poet_hf  # noqa: F401  (registers the tuners)
from poet_hf import MergeReinitCallback, PoetConfig, PoetTrainer, PoetTrainingArguments, create_poet_optimizer
from poet_hf.tuners.poet import POET_FINETUNE_RECIPES
from poet_hf.tuners.rotation.layer import rotation_layers

RECIPE = POET_FINETUNE_RECIPES["default"]


def group_signature(optimizer: torch.optim.Optimizer) -> list[tuple]:
    return [
        (g["lr"], g["weight_decay"], g.get("poet", False), g.get("block_size"), [id(p) for p in g["params"]])
        for g in optimizer.param_groups
    ]


def milton_rows(corpus_dir, split: str, characters: int = 600) -> list[str]:
    text = json.loads((corpus_dir / f"{split}.jsonl").read_text())["text"]
    return [text[i : i + characters] for i in range(0, len(text) - characters, characters)]


@pytest.mark.testbed
@pytest.mark.slow
def test_sft_trainer_with_the_public_optimizer_has_poet_trainers_groups_and_lowers_the_loss(tmp_path):
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from benchmarks import testbed

    model_dir, corpus = testbed.ensure_causal_lm(threads=1), testbed.milton_corpus()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    # Two block sizes, so that the per-side scaling has two groups to get right: R in 32-blocks, P in 64-blocks.
    config = PoetConfig.for_finetuning(block_size={"input": 32, "output": 64}, task_type="CAUSAL_LM", merge_every=6)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir), config)
    sft_args = SFTConfig(
        output_dir=str(tmp_path / "sft"),
        max_steps=12,
        per_device_train_batch_size=8,
        learning_rate=1e-3,  # any trainable parameter but the rotations (none here)
        lr_scheduler_type="linear",
        max_length=128,
        report_to="none",
        save_strategy="no",
        logging_steps=4,
        seed=0,
        use_cpu=True,
        bf16=False,  # SFTConfig's default is bf16; this test is float32 on a CPU
        disable_tqdm=True,
    )
    optimizer = create_poet_optimizer(
        model, sft_args, poet_learning_rate=RECIPE.learning_rate, poet_reference_block=RECIPE.reference_block
    )

    poet_args = PoetTrainingArguments(
        output_dir=str(tmp_path / "poet"),
        learning_rate=1e-3,
        poet_learning_rate=RECIPE.learning_rate,
        poet_reference_block=RECIPE.reference_block,
        report_to="none",
        use_cpu=True,
    )
    assert group_signature(optimizer) == group_signature(PoetTrainer(model=model, args=poet_args).create_optimizer())

    # Independently of poet_param_groups: every skew parameter sits in one group, at lr·32/b for its side's b.
    rate_of = {id(p): g["lr"] for g in optimizer.param_groups for p in g["params"]}
    expected = {
        id(layer.rotation_parameter("default", side)): RECIPE.learning_rate * RECIPE.reference_block / spec.block
        for _, layer in rotation_layers(model)
        for side, spec in layer.sides("default").items()
    }
    assert rate_of == expected and sorted(set(expected.values())) == [RECIPE.learning_rate / 2, RECIPE.learning_rate]

    validation = Dataset.from_dict({"text": milton_rows(corpus, "validation")[:32]})
    trainer = SFTTrainer(
        model=model,
        args=sft_args,
        train_dataset=Dataset.from_dict({"text": milton_rows(corpus, "train")}),
        eval_dataset=validation,
        processing_class=tokenizer,
        optimizers=(optimizer, None),
        callbacks=[merges := MergeReinitCallback()],
    )
    before = trainer.evaluate()["eval_loss"]
    trainer.train()
    after = trainer.evaluate()["eval_loss"]
    assert after < before - 0.05, (before, after)
    # The Trainer stepped this optimizer, its scheduler scaled both groups alike, and the merges ran (and reset).
    assert [g["lr"] for g in optimizer.param_groups] == [0.0, 0.0]  # linear decay to 0 at the last step
    assert [m["step"] for m in merges.history] == [6, 12]
    assert all(int(layer.merge_counts["default"]) == 2 for _, layer in rotation_layers(model))


def skew_rates(optimizer: torch.optim.Optimizer, model) -> dict[tuple[str, str], float]:
    """The learning rate of each layer side's skew parameter, read off the optimizer's groups."""
    rate_of = {id(p): g["lr"] for g in optimizer.param_groups for p in g["params"]}
    return {
        (name, side): rate_of[id(layer.rotation_parameter("default", side))]
        for name, layer in rotation_layers(model)
        for side in layer.sides("default")
    }


def side_blocks(model) -> dict[tuple[str, str], int]:
    layers = rotation_layers(model)
    return {(name, side): spec.block for name, layer in layers for side, spec in layer.sides("default").items()}


@pytest.mark.parametrize("recipe", ["default", "finetune blocks 32 / 64"])
def test_default_arguments_train_a_recipe_config_at_the_recipes_rate(tmp_path, caplog, monkeypatch, recipe):
    """`PoetTrainer` with ``PoetTrainingArguments(output_dir=…)`` alone (transformers' learning_rate 5e-5, no
    poet_learning_rate) trains a `PoetConfig.for_finetuning` adapter at its recipe's rate: 5e-4 at a 32-block side,
    5e-4 · 32/b at a b-block side, and says so once per model in the log."""
    from models import tiny_llama

    blocks = {"input": 32, "output": 64} if recipe != "default" else 32
    config = PoetConfig.for_finetuning(block_size=blocks, target_modules=["q_proj", "up_proj"])
    model = get_peft_model(tiny_llama(), config)
    args = PoetTrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    assert args.learning_rate == 5e-5 and args.poet_learning_rate is None
    with caplog.at_level("WARNING"):
        optimizer = PoetTrainer(model=model, args=args).create_optimizer()
        PoetTrainer(model=model, args=args).create_optimizer()
    expected = {key: 5e-4 * 32 / block for key, block in side_blocks(model).items()}
    assert skew_rates(optimizer, model) == pytest.approx(expected, rel=1e-12)
    if recipe != "default":
        assert set(expected.values()) == {5e-4, 2.5e-4}
    assert sum("poet_learning_rate is not set" in r.getMessage() for r in caplog.records) == 1


def test_default_arguments_train_a_pretraining_config_at_the_papers_tied_rate(tmp_path):
    """Without a recipe rate, a POET-BS adapter trains at the POET paper's Tables 8–9 tie, 1e-3 · 256/b per side; an
    explicit poet_learning_rate still wins, for every side."""
    from models import tiny_llama

    model = get_peft_model(tiny_llama(), PoetConfig(block_size={"input": 32, "output": 64}, target_modules=["up_proj"]))
    args = PoetTrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    optimizer = PoetTrainer(model=model, args=args).create_optimizer()
    blocks = side_blocks(model)
    assert sorted(set(blocks.values())) == [32, 64]
    assert skew_rates(optimizer, model) == pytest.approx({k: 1e-3 * 256 / b for k, b in blocks.items()}, rel=1e-12)
    explicit = PoetTrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True, poet_learning_rate=2e-3)
    optimizer = PoetTrainer(model=model, args=explicit).create_optimizer()
    assert set(skew_rates(optimizer, model).values()) == {2e-3}
