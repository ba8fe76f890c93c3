"""Fine-tuning a small pretrained model with `scripts/finetune.py` (POET, OFT, LoRA) lowers
the evaluation loss, and the exported merged model reproduces the fine-tuned logits."""

import json
import math
from pathlib import Path

import pytest
import torch
from models import tiny_llama
from script_modules import load_module
from testbed_runs import run_on_testbed
from transformers import AutoModelForCausalLM

import poet_hf  # noqa: F401
from poet_hf.data import load_corpus, load_tokenizer, pack_sequences
from poet_hf.diagnostics import rotation_angle
from poet_hf.recipes.finetune import FinetuneArguments
from poet_hf.tuners.rotation.layer import rotation_layers

ROOT = Path(__file__).resolve().parent.parent


def finetune_main(argv: list[str]) -> dict:
    return load_module(ROOT / "scripts" / "finetune.py").main(argv)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A tiny LLaMA briefly pretrained on the embedded corpus's training plays, saved with its tokenizer, and a
    held-out play (the corpus's validation play) as a local .txt fine-tuning corpus."""
    root = tmp_path_factory.mktemp("finetune")
    tokenizer = load_tokenizer(None)
    corpus = load_corpus()
    train = pack_sequences(corpus["train"].select(range(3)), tokenizer, seq_len=64)
    model = tiny_llama(vocab=len(tokenizer), max_position_embeddings=64, tie_word_embeddings=False).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    ids = torch.tensor(train["input_ids"])
    losses = []
    for _ in range(40):
        batch = ids[torch.randint(0, len(ids), (8,), generator=generator)]
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
    assert losses[-1] < losses[0] - 1.0  # it really pretrained
    model.save_pretrained(root / "pretrained")
    tokenizer.save_pretrained(root / "pretrained")
    (root / "heldout.txt").write_text(corpus["validation"][0]["text"])
    return root


COMMON = [
    "--seq_len",
    "64",
    "--block_size",
    "16",
    "--max_steps",
    "20",
    "--per_device_train_batch_size",
    "8",
    "--max_eval_samples",
    "16",
    "--logging_steps",
    "1000",
    "--seed",
    "0",
    "--disable_tqdm",
    "true",
]


@pytest.mark.parametrize(
    "method,extra",
    [
        ("oft", ["--learning_rate", "1e-2"]),
        ("poet", ["--learning_rate", "1e-2", "--merge_every", "7"]),
        ("lora", ["--learning_rate", "3e-3"]),
        ("oft", ["--learning_rate", "1e-2", "--base_quantization", "nf4"]),
        ("poet", ["--learning_rate", "1e-2", "--merge_every", "7", "--base_quantization", "int8"]),
    ],
)
def test_finetune_lowers_eval_loss_and_export_reproduces_logits(workspace, method, extra):
    quantization = extra[-1] if "--base_quantization" in extra else None
    out = workspace / f"out_{method}_{quantization}"
    export = workspace / f"export_{method}_{quantization}"
    results = finetune_main(
        [
            "--model_name_or_path",
            str(workspace / "pretrained"),
            "--method",
            method,
            "--dataset",
            str(workspace / "heldout.txt"),
            "--output_dir",
            str(out),
            "--export_dir",
            str(export),
            *COMMON,
            *extra,
        ]
    )
    before, after = results["before"]["loss"], results["after"]["loss"]
    assert after < before - 0.05, (before, after)
    assert results["steps"] == 20
    written = json.loads((out / "results.json").read_text())
    assert written["after"]["loss"] == after and written["before"]["loss"] == before
    if method == "poet":  # merge-then-reinitialize ran during fine-tuning (20 steps, every 7)
        callback = next(cb for cb in results["trainer"].callback_handler.callbacks if hasattr(cb, "history"))
        assert [h["step"] for h in callback.history] == [7, 14]
        if quantization:  # each merge requantised W0, and said by how much
            assert all(0 < h["max_requantization_error"] < 0.05 for h in callback.history)
    if quantization:
        layers = rotation_layers(results["trainer"].model)
        assert layers and all(layer.base_quantization == quantization for _, layer in layers)

    finetuned = results["trainer"].model.eval()
    ids = torch.randint(0, 4096, (2, 32), generator=torch.Generator().manual_seed(3))
    exported = AutoModelForCausalLM.from_pretrained(export).eval()
    assert not any("poet" in n or "lora" in n for n, _ in exported.named_parameters())
    with torch.no_grad():
        expected = finetuned(input_ids=ids).logits
        got = exported(input_ids=ids).logits
    assert (got - expected).abs().max() <= 1e-4 * expected.abs().max()


def test_the_evaluation_at_the_last_step_is_the_after_one_and_is_not_repeated(workspace, tmp_path):
    from transformers import TrainerCallback

    from poet_hf.recipes.finetune import parse_finetune_arguments, run_finetuning

    class Steps(TrainerCallback):
        def __init__(self):
            self.steps = []

        def on_evaluate(self, args, state, control, **kwargs):
            self.steps.append(state.global_step)

    evaluations = Steps()
    args, training = parse_finetune_arguments(
        model_name_or_path=str(workspace / "pretrained"),
        method="poet",
        dataset=str(workspace / "heldout.txt"),
        output_dir=str(tmp_path),
        seq_len=64,
        block_size=16,
        max_steps=8,
        per_device_train_batch_size=8,
        max_eval_samples=16,
        eval_steps=3,
        learning_rate=1e-2,
        merge_every=4,  # a merge at the last step, before its evaluation
        disable_tqdm=True,
    )
    assert training.eval_strategy == "steps"  # eval_steps given: the recipe's default strategy follows it
    results = run_finetuning(args, training, callbacks=[evaluations])
    # Before training, every 3 steps, and at the last step (transformers adds it when eval_steps does not divide it).
    assert evaluations.steps == [0, 3, 6, 8]
    # The reported loss is the final model's: a new evaluation of it agrees to the bit.
    assert results["after"]["loss"] == results["trainer"].evaluate()["eval_loss"]
    assert results["after"]["loss"] < results["before"]["loss"]


def test_classification_reports_accuracy_before_and_after(workspace, tmp_path):
    # Label: is the line a question? A decoder classifier reads the last token, so this is learnable quickly.
    lines = [line.strip() for line in (workspace / "heldout.txt").read_text().splitlines() if len(line.split()) >= 3]
    questions = [line for line in lines if line.endswith("?")][:150]
    others = [line for line in lines if not line.endswith("?")][: len(questions)]
    rows = [
        {"text": line, "label": int(line.endswith("?"))}
        for pair in zip(questions, others, strict=True)
        for line in pair
    ]
    assert len(rows) >= 200
    data = tmp_path / "lines.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows))
    results = finetune_main(
        [
            "--model_name_or_path",
            str(workspace / "pretrained"),
            "--method",
            "oft",
            "--task",
            "sequence-classification",
            "--dataset",
            str(data),
            "--output_dir",
            str(tmp_path / "o"),
            "--seq_len",
            "32",
            "--block_size",
            "16",
            "--max_steps",
            "30",
            "--per_device_train_batch_size",
            "16",
            "--learning_rate",
            "3e-3",
            "--logging_steps",
            "1000",
            "--disable_tqdm",
            "true",
        ]
    )
    assert set(results["before"]) == {"loss", "accuracy"}
    assert results["after"]["loss"] < results["before"]["loss"]
    assert results["after"]["accuracy"] >= 0.8 > results["before"]["accuracy"]


@pytest.mark.parametrize(
    "fields,named",
    [
        ({"method": "adapter"}, "`method`"),
        ({"task": "ner"}, "`task`"),
        ({"method": "oft", "spo": "full"}, "`spo`"),
        ({"method": "poet", "recipe": "fast"}, "`recipe`"),
        ({"method": "oft", "recipe": "paper"}, "`recipe`"),
        ({"task": "sequence-classification"}, "`dataset`"),
    ],
)
def test_bad_arguments_are_named(fields, named):
    with pytest.raises(ValueError, match=named):
        FinetuneArguments(model_name_or_path="x", **fields)


def test_cli_defaults_are_the_config_classes_and_the_poet_recipes():
    from models import tiny_llama

    from poet_hf import OftConfig, PoetConfig
    from poet_hf.recipes.finetune import method_config, parse_finetune_arguments
    from poet_hf.tuners.poet import POET_FINETUNE_RECIPES

    model = tiny_llama()
    for method, config_class in (("poet", PoetConfig), ("oft", OftConfig)):
        config = method_config(FinetuneArguments(model_name_or_path="x", method=method), model)
        for name in ("neumann_terms", "merge_every"):
            assert getattr(config, name) == config_class.__dataclass_fields__[name].default, (method, name)
    assert (
        method_config(FinetuneArguments(model_name_or_path="x", method="oft"), model).block_size == OftConfig.block_size
    )
    for name, recipe in POET_FINETUNE_RECIPES.items():
        args, training = parse_finetune_arguments(["--model_name_or_path", "x", "--method", "poet", "--recipe", name])
        config = method_config(args, model)
        assert {field: getattr(config, field) for field in recipe.config} == recipe.config
        assert config == PoetConfig.for_finetuning(name, target_modules=config.target_modules, task_type="CAUSAL_LM")
        assert (training.poet_learning_rate, training.poet_reference_block) == (recipe.learning_rate, 32)
        assert training.learning_rate == 1e-3  # a new head's (none here), OFT's and LoRA's
    # What the command line sets wins over the recipe, in the script's options and in the training flags.
    args, training = parse_finetune_arguments(
        ["--model_name_or_path", "x", "--method", "poet", "--block_size", "16", "--learning_rate", "3e-4"]
    )
    assert method_config(args, model).block_size == 16 and training.learning_rate == 3e-4
    assert training.poet_reference_block == 32 and training.poet_learning_rate == 3e-4  # --learning_rate sets both
    assert parse_finetune_arguments(["--model_name_or_path", "x", "--method", "oft"])[1].poet_reference_block is None


def test_the_scripts_own_options_and_every_training_flag_parse_together():
    from poet_hf.recipes.finetune import parse_finetune_arguments

    argv = [
        "--model_name_or_path",
        "x",
        "--method",
        "poet-fs",
        "--bf16",
        "--activation_checkpointing",
        "--optim",
        "adamw_torch",
    ]
    args, training = parse_finetune_arguments(
        [*argv, "--per_device_train_batch_size", "4", "--seed", "3", "--torch_compile", "true", "--max_steps", "7"]
    )
    assert (args.method, args.recipe, args.spo) == ("poet", "paper", "full")  # the pretraining script's name
    assert training.bf16 and training.activation_checkpointing and training.torch_compile
    assert (training.optim, training.max_steps, training.seed, training.data_seed) == ("adamw_torch", 7, 3, 3)
    assert (training.per_device_train_batch_size, training.per_device_eval_batch_size) == (4, 4)
    # The same from keyword fields; the former spellings are unknown fields.
    args, training = parse_finetune_arguments(model_name_or_path="x", per_device_train_batch_size=4, max_steps=7)
    assert (training.per_device_train_batch_size, training.max_steps, training.output_dir) == (4, 7, "outputs/finetune")
    for former in ("steps", "batch_size", "model"):
        with pytest.raises(ValueError, match=f"unknown field.*'{former}'"):
            parse_finetune_arguments(model_name_or_path="x", **{former: 7})


@pytest.mark.testbed
@pytest.mark.parametrize("method", ["poet", "oft", "lora"])
def test_every_method_at_its_defaults_improves_the_pretrained_model(testbed, tmp_path, caplog, method):
    with caplog.at_level("WARNING", logger="poet_hf.training.callback"):
        results, evaluations = run_on_testbed(testbed, tmp_path, method=method, max_steps=20, evaluate_at=(5,))
    before = results["before"]["loss"]
    assert results["after"]["loss"] < before - 0.1  # from 6.13: POET 5.83, OFT 5.97, LoRA 5.99 after 20 steps
    assert evaluations[5] < before  # the first steps do not damage the model
    assert not [r for r in caplog.records if "FINETUNE_WARN_ANGLE" in r.getMessage()]


@pytest.mark.testbed
def test_poet_rates_scale_with_the_block_size_so_large_blocks_do_not_damage_the_model(testbed, tmp_path):
    # PoetConfig used directly with a plain transformers.Trainer: the paper's fully stochastic setting (index sets of
    # 128 and 384 here) at lr 1e-2. One rate for every side turns the big blocks by lr·b per step and the loss after
    # 5 steps is above the starting loss; the groups of poet_param_groups (a side trains at lr·32/b) are not.
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments, default_data_collator

    from poet_hf import MergeReinitCallback, PoetConfig
    from poet_hf.data import load_corpus, load_tokenizer, pack_sequences
    from poet_hf.training import poet_param_groups

    model_dir, data = testbed
    tokenizer = load_tokenizer(str(model_dir))
    corpus = load_corpus(str(data))
    train = pack_sequences(corpus["train"], tokenizer, 128)
    validation = pack_sequences(corpus["validation"], tokenizer, 128).select(range(64))
    losses = {}
    for reference in (None, 32):
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir), PoetConfig(spo="full", seed=0))
        optimizer = torch.optim.AdamW(poet_param_groups(model, 1e-2, 1e-2, 0.0, [], reference_block=reference))
        args = TrainingArguments(
            output_dir=str(tmp_path),
            max_steps=5,
            per_device_train_batch_size=8,
            per_device_eval_batch_size=32,
            lr_scheduler_type="constant",
            report_to="none",
            seed=0,
            data_seed=0,
            use_cpu=True,
            disable_tqdm=True,
            save_strategy="no",
        )
        trainer = Trainer(
            model=model,
            args=args,
            train_dataset=train,
            eval_dataset=validation,
            data_collator=default_data_collator,
            optimizers=(optimizer, None),
            callbacks=[MergeReinitCallback()],
        )
        start = trainer.evaluate()["eval_loss"]
        trainer.train()
        losses[reference] = (start, trainer.evaluate()["eval_loss"])
    assert losses[None][1] > losses[None][0]  # one rate: 6.13 -> 6.23
    assert losses[32][1] < losses[32][0]  # per block size: 6.13 -> 5.96


@pytest.mark.testbed
def test_a_rotation_rate_far_too_large_for_fine_tuning_is_warned_about_early(testbed, tmp_path, caplog):
    with caplog.at_level("WARNING", logger="poet_hf.training.callback"):
        results, _ = run_on_testbed(testbed, tmp_path, method="poet", learning_rate=3e-2, max_steps=10)
    warnings = [r.getMessage() for r in caplog.records if "FINETUNE_WARN_ANGLE" in r.getMessage()]
    assert len(warnings) == 1 and "0.03" in warnings[0]
    layers = [layer for _, layer in rotation_layers(results["trainer"].model)]
    assert max(rotation_angle(layer) for layer in layers) > 90  # about 230° at step 5


@pytest.mark.parametrize("flags", [["--activation_checkpointing"], ["--bf16"]])
def test_the_finetuning_script_takes_trainer_flags(workspace, tmp_path, flags):
    """As for pretraining: the blocks are recomputed in the backward; the run is under bf16 autocast on a CPU, or
    refused up front on one without AVX-512."""
    from training_utils import TrainingForwards

    argv = [
        "--model_name_or_path",
        str(workspace / "pretrained"),
        "--method",
        "poet",
        "--dataset",
        str(workspace / "heldout.txt"),
    ]
    argv += ["--output_dir", str(tmp_path), *COMMON, "--max_steps", "2", *flags]
    if flags == ["--bf16"] and not torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        with pytest.raises(ValueError, match="bfloat16 attention kernels for CPUs need AVX-512"):
            finetune_main(argv)
        return
    with TrainingForwards() as seen:
        results = finetune_main(argv)
    assert results["steps"] == 2 and math.isfinite(results["after"]["loss"])
    if flags == ["--activation_checkpointing"]:
        assert seen.recomputed > 0 and seen.linear_dtypes == {torch.float32}
    else:
        assert torch.bfloat16 in seen.linear_dtypes and seen.recomputed == 0
