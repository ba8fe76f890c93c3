"""``scripts/pretrain.py`` on any causal LM: ``--config_name``/``--config_overrides`` for LLaMA, Mistral, Qwen2, Gemma
and GPT-2 (``Conv1D``), ``--model_name_or_path`` for continued pretraining, and one flag list for a run and its plan.

References: each layer's widths with the divisor rule worked out here (every divisor of a width, the nearest to 256),
a plain ``transformers`` model's loss in float64 on the same rows, and `plan_memory` called with its own keywords.
"""

from __future__ import annotations

import json
import math
import re
import shlex
from pathlib import Path

import pytest
import torch
from script_modules import command_line_error, load_module
from tolerances import gamma, unit_roundoff
from transformers import GemmaConfig, GPT2Config, LlamaConfig, MistralConfig, Qwen2Config

from poet_hf import plan_memory
from poet_hf.recipes.pretrain import (
    load_data,
    parse_pretrain_arguments,
    run_pretraining,
    run_tokenizer,
)

ROOT = Path(__file__).resolve().parent.parent
# Widths where the rule has work to do: 256 divides 512 and neither 384 nor 1152 (GPT-2's fused q, k, v).
LLAMA_LIKE = (
    "hidden_size=384,num_hidden_layers=2,intermediate_size=512,num_attention_heads=6,num_key_value_heads=2,"
    "vocab_size=4096"
)
HEADS_64 = LLAMA_LIKE + ",head_dim=64"  # where the config writes its head width (128 or 256) into its JSON
FAMILIES = {
    "llama": (LlamaConfig, HEADS_64),
    "mistral": (MistralConfig, HEADS_64),
    "qwen2": (Qwen2Config, LLAMA_LIKE),
    "gemma": (GemmaConfig, HEADS_64),
    "gpt2": (GPT2Config, "n_embd=384,n_layer=2,n_head=6,n_inner=512,vocab_size=4096"),
}
SHORT_RUN = ["--max_steps", "2", "--seq_len", "32", "--per_device_train_batch_size", "2"]
SHORT_RUN += ["--gradient_accumulation_steps", "1", "--max_eval_samples", "4", "--logging_steps", "1000"]


def nearest_divisor_by_hand(width: int, wanted: int = 256) -> int:
    """Of every divisor of ``width`` but 1, the one nearest to ``wanted`` (the smaller on a tie, as documented)."""
    divisors = [d for d in range(2, width + 1) if width % d == 0]
    return min(divisors, key=lambda d: (abs(d - wanted), d))


def write_config(folder: Path, family: str) -> Path:
    path = folder / f"{family}.json"
    FAMILIES[family][0]().to_json_file(str(path))  # the family's default shape; the overrides make it tiny
    return path


def print_recipe(capsys, argv: list[str]) -> dict:
    script = load_module(ROOT / "scripts" / "pretrain.py")
    recipe = script.main([*argv, "--print_recipe"])
    capsys.readouterr()
    return recipe


def target_widths(family: str, config_path: Path) -> dict[str, tuple[int, int]]:
    """(in, out) of every target inside a block, from the model transformers builds (no poet_hf involved)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.pytorch_utils import Conv1D

    values = json.loads(config_path.read_text())
    values.pop("layer_types", None)  # derived from the number of layers, which the overrides change
    values.update({key: int(value) for key, value in (entry.split("=") for entry in FAMILIES[family][1].split(","))})
    config = AutoConfig.for_model(**values)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    widths = {}
    for name, module in model.named_modules():
        inside = re.split(r"\.\d+\.", name)[-1]
        if ".0." in name and isinstance(module, torch.nn.Linear):
            widths[inside] = (module.in_features, module.out_features)
        elif ".0." in name and isinstance(module, Conv1D):
            widths[inside] = tuple(module.weight.shape)  # Conv1D stores in × out
    return widths


@pytest.mark.parametrize("family", list(FAMILIES))
def test_recipe_shows_each_targets_block_sizes_by_the_divisor_rule(family, tmp_path, capsys):
    config = write_config(tmp_path, family)
    recipe = print_recipe(capsys, ["--config_name", str(config), "--config_overrides", FAMILIES[family][1]])
    widths = target_widths(family, config)
    targets = recipe["targets"]
    expected = {
        name: {"input": nearest_divisor_by_hand(i), "output": nearest_divisor_by_hand(o)}
        for name, (i, o) in widths.items()
        if name.rsplit(".", 1)[-1] in targets
    }
    assert recipe["block_sizes"] == expected
    assert recipe["model"]["model_type"] == family and recipe["model"]["hidden"] == 384
    assert any(side["input"] == 192 for side in expected.values())  # 384: the rule's work, not the request
    if family == "gpt2":
        assert expected["attn.c_attn"]["output"] == 288  # 1152 = 4.5 × 256
        assert recipe["trained_in_full"] == ["ln_1", "ln_2", "ln_f", "wpe", "wte"]  # the head is tied to wte
    else:
        assert {"embed_tokens", "norm"} <= set(recipe["trained_in_full"])


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_pretrains_two_steps_from_a_config_of_each_family(family, tmp_path):
    config = write_config(tmp_path, family)
    args, training = parse_pretrain_arguments(
        ["--config_name", str(config), "--config_overrides", FAMILIES[family][1], *SHORT_RUN]
        + ["--output_dir", str(tmp_path / "run")]
    )
    results = run_pretraining(args, training)
    assert results["steps"] == 2 and results["recipe"]["model"]["model_type"] == family
    assert math.isfinite(results["val_loss"]) and results["val_loss"] < results["initial_val_loss"]


@pytest.mark.parametrize(
    ("train_text", "message"),
    [
        ("a few words.\n", "the train split of `dataset`='{corpus}' gives 0 sequences of 256 tokens"),
        ("word " * 4000 + "\n", "the validation set has 0 sequences, fewer than one batch"),
    ],
)
def test_an_empty_split_is_named_before_the_run_writes_anything(tmp_path, train_text, message):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "train.txt").write_text(train_text)
    (corpus / "validation.txt").write_text("word " * (4000 if train_text.startswith("a") else 3) + "\n")
    args, training = parse_pretrain_arguments(["--dataset", str(corpus), "--output_dir", str(tmp_path / "run")])
    with pytest.raises(ValueError, match=re.escape(message.format(corpus=corpus))):
        run_pretraining(args, training)
    assert not (tmp_path / "run").exists()


def test_a_config_that_declares_float16_pretrains_in_float32(tmp_path):
    """Llama-2's config says ``"torch_dtype": "float16"``, which ``from_config`` honours; the run builds the model in
    float32 whatever the config says (Adam does not train float16 weights)."""
    path = write_config(tmp_path, "llama")
    config = LlamaConfig.from_json_file(str(path))
    config.torch_dtype = "float16"
    config.to_json_file(str(path))
    args, training = parse_pretrain_arguments(
        ["--config_name", str(path), "--config_overrides", FAMILIES["llama"][1], *SHORT_RUN]
        + ["--output_dir", str(tmp_path / "run")]
    )
    results = run_pretraining(args, training)
    assert results["steps"] == 2 and math.isfinite(results["val_loss"])
    assert results["val_loss"] < results["initial_val_loss"]


def _checkpoint(folder: Path) -> Path:
    torch.manual_seed(0)
    from transformers import LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=4096, hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=2
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def plain_loss_in_float64(checkpoint: Path, rows) -> float:
    """The checkpoint's mean next-token loss on ``rows`` in float64, by transformers alone."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float64).eval()
    ids = torch.tensor([row["input_ids"] for row in rows])
    with torch.no_grad():
        return float(model(input_ids=ids, labels=ids).loss)


@pytest.mark.slow
def test_continued_pretraining_starts_from_the_checkpoints_loss_and_trains(tmp_path):
    """With ``--model_name_or_path`` the checkpoint's weights are ``W0`` (kept, not re-initialised) and the rotations
    start at the identity, so the first evaluation is the checkpoint's own loss; two steps then lower it."""
    checkpoint = _checkpoint(tmp_path / "checkpoint")
    args, training = parse_pretrain_arguments(
        ["--model_name_or_path", str(checkpoint), *SHORT_RUN, "--output_dir", str(tmp_path / "run")]
    )
    assert args.base_init is None  # the checkpoint's weights stay
    with pytest.warns(UserWarning, match="holds no tokenizer"):  # saved without one: the embedded BPE, said so
        results = run_pretraining(args, training)
    _, validation = load_data(args, run_tokenizer(args), training.seed)
    reference = plain_loss_in_float64(checkpoint, validation)
    # The identity rotations multiply exactly, so the run's float32 forward is the plain one up to rounding: per block
    # the projections (64), scores and values (32 tokens each), the output (64) and the MLP (64 + 128); then the head
    # (64), the softmax over 4096 entries and the mean over 4 × 31 targets.
    terms = 2 * (64 + 32 + 32 + 64 + 64 + 128) + 64 + 4096 + 4 * 31
    assert abs(results["initial_val_loss"] - reference) <= 2 * gamma(terms, torch.float32) * reference
    assert results["val_loss"] < results["initial_val_loss"]
    assert results["recipe"]["base_init"] is None


def test_a_checkpoint_folder_with_a_tokenizer_gives_the_runs_tokenizer(tmp_path):
    import warnings

    from poet_hf.data import load_tokenizer

    checkpoint = _checkpoint(tmp_path / "checkpoint")
    saved = load_tokenizer()
    saved.add_tokens(["<added-by-this-checkpoint>"])  # tells its tokenizer from the embedded one
    saved.save_pretrained(checkpoint)
    args, _ = parse_pretrain_arguments(["--model_name_or_path", str(checkpoint)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(run_tokenizer(args)) == len(load_tokenizer()) + 1


PLAN_FLAGS = [
    "--config_name",
    str(ROOT / "configs" / "models" / "llama-2-7b.json"),
    "--per_device_train_batch_size",
    "1",
    "--gradient_accumulation_steps",
    "1",
    "--activation_checkpointing",
    "--base_quantization",
    "nf4",
    "--fused_optimizer_step",
    "--optim",
    "adamw_bnb_8bit",
]


def test_a_plan_and_a_run_take_one_flag_list(capsys):
    """The same flags parse as a run (``pretrain.py``) and plan (``plan_memory.py``): the plan is `plan_memory`
    called with that run's settings spelled as its own keywords."""
    args, training = parse_pretrain_arguments(PLAN_FLAGS)  # a run's parse of them
    assert training.fused_optimizer_step and args.base_quantization == "nf4"
    planner = load_module(ROOT / "scripts" / "plan_memory.py")
    assert planner.main([*PLAN_FLAGS, "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)[0]
    by_keywords = plan_memory(
        str(ROOT / "configs" / "models" / "llama-2-7b.json"),
        "poet-bs",
        block_size=256,
        batch_size=1,
        seq_len=256,
        checkpointing=True,
        accumulation=1,
        base_quantization="nf4",
        fused_step=True,
        optimizer_bits=8,
    )
    assert planned["total_mb"] == by_keywords.total_bytes / 2**20


def test_the_former_plan_spelling_is_refused_and_help_lists_the_plan_options(capsys):
    planner = load_module(ROOT / "scripts" / "plan_memory.py")
    with pytest.raises(SystemExit):
        planner.main(["--model", str(ROOT / "configs" / "models" / "llama-2-7b.json"), "--batch_size", "1"])
    capsys.readouterr()
    assert planner.main(["--help"]) == 0
    shown = capsys.readouterr().out
    for flag in ("--compare", "--processes", "--sharding", "--dtype", "--json", "--per_device_train_batch_size"):
        assert flag in shown, flag


def test_the_documented_7b_plan_command_prints_the_pages_table(capsys):
    """docs/pretraining-7b.md's plan_memory.py command, run as written, prints the table rendered under it, part by
    part, in the unit the table names (MiB)."""
    section = (ROOT / "docs" / "pretraining-7b.md").read_text().split("## Where the memory goes")[1]
    argv = shlex.split(section.split("`")[1])
    assert argv[:2] == ["python", "scripts/plan_memory.py"]
    assert load_module(ROOT / "scripts" / "plan_memory.py").main(argv[2:]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].split()[:3] == ["MiB", "per", "process"]
    table = section.split("<!-- table: plan_7b -->")[1].split("<!-- /table -->")[0].strip().splitlines()
    assert table[0].startswith("| MiB per process")
    rendered = {cells[0].strip("* "): [c.strip("* ") for c in cells[1:]] for cells in _rows(table[2:])}
    for line in printed[1:]:  # "<part>   <poet-bs>   <adamw>", the parts' sum as "sum"
        *words, poet, adamw = line.split()
        part = "total" if words == ["sum"] else " ".join(words)
        if part in rendered:  # the same MiB, printed to 0.1 and rendered to 1: half of each last digit apart at most
            for printed_value, rendered_value in zip((poet, adamw), rendered.pop(part), strict=True):
                assert abs(float(printed_value) - float(rendered_value)) <= 0.55, (part, printed_value, rendered_value)
    assert not rendered, f"rows of the page's table the command did not print: {sorted(rendered)}"


def _rows(lines: list[str]) -> list[list[str]]:
    return [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in lines]


def test_plan_dtype_takes_either_spelling(capsys):
    planner = load_module(ROOT / "scripts" / "plan_memory.py")
    totals = []
    for spelling in ("bf16", "bfloat16"):
        assert planner.main([*PLAN_FLAGS, "--dtype", spelling, "--json"]) == 0
        totals.append(json.loads(capsys.readouterr().out)[0]["total_mb"])
    assert planner.main([*PLAN_FLAGS, "--json"]) == 0
    assert totals[0] == totals[1] < json.loads(capsys.readouterr().out)[0]["total_mb"]  # 2-byte weights plan less


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--config_overrides", "hidden_sise=64"], "--config_overrides entry 'hidden_sise=64'"),
        (["--seq_len", "100000"], "--seq_len=100000 is longer than the model's `max_position_embeddings`"),
        (
            ["--model_name_or_path", "x", "--config_name", "y"],
            "--config_name and --model_name_or_path both name the model",
        ),
    ],
)
def test_bad_model_flags_are_one_line_naming_the_field(flags, message, tmp_path, capsys):
    config = write_config(tmp_path, "llama")
    argv = ["--config_name", str(config), *flags] if "--config_name" not in flags else flags
    assert message in command_line_error(capsys, lambda: print_recipe(capsys, argv))


def test_a_vocabulary_smaller_than_the_tokenizer_is_named_before_the_build(tmp_path, capsys):
    config = write_config(tmp_path, "llama")
    with pytest.raises(ValueError, match=re.escape("`vocab_size`=100, from --config_overrides) is smaller than the")):
        print_recipe(capsys, ["--config_name", str(config), "--config_overrides", "vocab_size=100"])


def test_a_vocabulary_smaller_than_the_tokenizer_is_refused_before_the_run_writes_anything(tmp_path):
    """A preset model takes the tokenizer's vocabulary; one set smaller would meet token ids it has no embedding for
    (an IndexError in the first forward): the run refuses before it loads data or writes into its folder."""
    args, training = parse_pretrain_arguments(["--config_overrides", "vocab_size=100", "--output_dir", str(tmp_path)])
    with pytest.raises(
        ValueError, match=re.escape("is smaller than the tokenizer's 4096 tokens, so token ids from 100")
    ):
        run_pretraining(args, training)
    assert list(tmp_path.iterdir()) == []


def test_the_tuner_warns_of_untargeted_block_weights_only_where_they_train_in_full():
    """The warning is the POET tuner's: `get_peft_model` with a config that trains the other parameters names Mixtral's
    fused experts (2 experts of 3·512·1024 entries, and the 512·2 router, against 4 rotated 512×512 attention
    weights); fine-tuning, which trains the rotations alone, says nothing."""
    import warnings

    from peft import get_peft_model
    from transformers import AutoModelForCausalLM, MixtralConfig

    from poet_hf import PoetConfig
    from poet_hf.tuners.poet import UntargetedWeightsWarning

    config = MixtralConfig(
        hidden_size=512, intermediate_size=1024, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4,
        num_local_experts=2, vocab_size=128,
    )  # fmt: skip

    def wrap(**fields):
        with torch.device("meta"):
            return get_peft_model(AutoModelForCausalLM.from_config(config), PoetConfig(block_size=32, **fields))

    with pytest.warns(UntargetedWeightsWarning) as caught:
        wrap(train_other_params=True)
    rotated, experts = 4 * 512 * 512, 2 * 3 * 512 * 1024 + 512 * 2
    message = str(caught[0].message)
    assert f"rotates {rotated / 1e6:.1f}M block weights and trains {experts / 1e6:.1f}M in full" in message
    assert "experts (3.1M)" in message and "gate (0.0M)" in message
    with warnings.catch_warnings():
        warnings.simplefilter("error", UntargetedWeightsWarning)
        wrap()


def test_a_family_without_default_targets_is_refused_naming_the_supported_ones(tmp_path, capsys):
    from transformers import OPTConfig

    path = tmp_path / "opt.json"
    OPTConfig().to_json_file(str(path))
    with pytest.raises(ValueError, match=r"`model_type`='opt' has no default target modules; .*gpt2.*llama"):
        print_recipe(capsys, ["--config_name", str(path)])


def test_a_plan_for_several_processes_takes_the_accumulation_their_launch_would(capsys):
    """The tiny recipe's 8 sequences per step over 2 processes are micro-batches of 4 without accumulation."""
    from poet_hf.data import load_tokenizer
    from poet_hf.recipes.presets import PRESETS, preset_config

    planner = load_module(ROOT / "scripts" / "plan_memory.py")
    assert planner.main(["--preset", "tiny", "--processes", "2", "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)[0]
    assert (planned["settings"]["batch_size"], planned["settings"]["accumulation"]) == (4, 1)
    model = preset_config(PRESETS["tiny"], "poet-bs", len(load_tokenizer()), 256)
    reference = plan_memory(model, "poet-bs", block_size=32, batch_size=4, processes=2)
    assert planned["total_mb"] == reference.total_bytes / 2**20


@pytest.mark.parametrize("lora", [False, True])
def test_a_conv1d_targets_weight_is_the_out_by_in_matrix_its_forward_applies(lora):
    """GPT-2 stores ``Conv1D`` weights in × out; the diagnostics read them as out × in, with a LoRA delta folded in:
    ``x Wᵀ + b`` must be what the module computes (float64)."""
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2LMHeadModel

    from poet_hf.diagnostics import target_weight_matrices

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, n_inner=48, vocab_size=64)).double()
    if lora:
        model = get_peft_model(model, LoraConfig(r=4, target_modules=["c_fc"], fan_in_fan_out=True))
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(parameter)  # a delta that is not zero
    ((name, matrix),) = target_weight_matrices(model, ["mlp.c_fc"]).items()
    module = model.get_submodule(name)
    bias = (module.get_base_layer() if lora else module).bias
    x = torch.randn(5, 32, dtype=torch.float64)
    assert matrix.shape == (48, 32)
    # The matrix is read in float32: each entry within u of the module's, so each output within u·(|x| |W|ᵀ).
    bound = (x.abs() @ matrix.double().abs().T) * unit_roundoff(torch.float32) * 2
    assert ((x @ matrix.double().T + bias - module(x)).abs() <= bound).all()


def test_block_weights_that_are_not_linears_are_named_in_a_warning(tmp_path, capsys):
    """Mixtral's experts are one fused 3-D parameter in transformers 5: POET rotates the attention only and the
    experts train in full, which the run says; LLaMA's blocks, all linears, give no warning."""
    import warnings

    from transformers import AutoConfig, AutoModelForCausalLM, MixtralConfig

    from poet_hf.tuners.poet import UntargetedWeightsWarning

    path = tmp_path / "mixtral.json"
    MixtralConfig().to_json_file(str(path))
    overrides = HEADS_64
    with pytest.warns(UntargetedWeightsWarning, match=r"experts \(") as caught:
        recipe = print_recipe(capsys, ["--config_name", str(path), "--config_overrides", overrides])
    assert "experts" in recipe["trained_in_full"]
    values = {**json.loads(path.read_text()), **{k: int(v) for k, v in (e.split("=") for e in overrides.split(","))}}
    values.pop("layer_types", None)
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(AutoConfig.for_model(**values))
    experts = sum(p.numel() for name, p in plain.named_parameters() if ".experts." in name or ".gate." in name)
    messages = [str(w.message) for w in caught if w.category is UntargetedWeightsWarning]
    assert f"trains {experts / 1e6:.1f}M in full" in messages[0]
    llama = write_config(tmp_path, "llama")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UntargetedWeightsWarning)
        print_recipe(capsys, ["--config_name", str(llama), "--config_overrides", HEADS_64])
