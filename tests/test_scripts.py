"""Every command-line script prints its help, and every flag it takes has a help text."""

import contextlib
import dataclasses
import io
from pathlib import Path

import pytest
from script_modules import load_module

SCRIPTS = sorted((Path(__file__).resolve().parent.parent / "scripts").glob("*.py"))


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_help_runs_and_every_flag_is_explained(path):
    parser = load_module(path).build_parser()
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_info:
        parser.parse_args(["--help"])
    assert exit_info.value.code == 0 and out.getvalue().startswith("usage:")
    bare = [
        action.option_strings[0] if action.option_strings else action.dest
        for action in parser._actions
        if not action.help and action.dest != "help"
    ]
    assert not bare, f"{path.name}: flags without a help text: {bare}"


def option_defaults(name: str) -> dict[str, object]:
    """Every option of a script's parser, by its name, with its default."""
    parser = load_module(Path(SCRIPTS[0]).parent / name).build_parser()
    return {action.option_strings[0]: action.default for action in parser._actions if action.option_strings}


def test_the_training_scripts_share_their_common_options_names_and_defaults():
    pretrain, finetune = option_defaults("pretrain.py"), option_defaults("finetune.py")
    common = set(pretrain) & set(finetune)
    # Each job's own method is its default: POET-BS for pretraining, OFT for fine-tuning (`--method` names the same
    # SPO kinds in both, tests/test_recipe.py and tests/test_finetune.py).
    differing = {name for name in common if pretrain[name] != finetune[name]} - {"--method"}
    assert not differing, {name: (pretrain[name], finetune[name]) for name in differing}
    for shared in ("--seq_len", "--lora_rank", "--max_eval_samples", "--dataset", "--export_dir"):
        assert shared in common, shared


def test_each_jobs_defaults_are_its_recipes():
    from peft import LoraConfig

    from poet_hf.recipes.finetune import parse_finetune_arguments
    from poet_hf.recipes.pretrain import parse_pretrain_arguments

    pretrain, _ = parse_pretrain_arguments(["--output_dir", "unused"])
    finetune, _ = parse_finetune_arguments(["--model_name_or_path", "unused", "--output_dir", "unused"])
    assert (pretrain.seq_len, pretrain.lora_rank, pretrain.max_eval_samples) == (256, 64, 128)
    # Fine-tuning's LoRA is PEFT's LoraConfig as it comes.
    assert (finetune.seq_len, finetune.lora_rank, finetune.max_eval_samples) == (128, LoraConfig.r, 256)


# What third-party imports print on a machine their optional kernels do not suit (torchao's CUDA extensions and its
# pytree registrations, bitsandbytes' Hub kernel), and the FutureWarning PEFT's own read of a deprecated property
# raises: none of it is the user's doing.
NOISE = (  # import-time kernels, PEFT, DeepSpeed's accelerator probe, the Trainer aligning a new model's tokens
    "Failed to load",
    "register_constant",
    "FutureWarning",
    "is_gradient_checkpointing",
    "Setting accelerator to CPU",
    "PAD/BOS/EOS",
)


def test_the_readme_main_job_starts_quietly(tmp_path):
    """The README's main job, shortened to 2 steps, in a fresh interpreter as a user starts it: its output carries
    none of the import-time noise of the optional kernels, PEFT's FutureWarning, DeepSpeed's accelerator probe or the
    Trainer's alignment of special tokens, and still its perplexity."""
    import subprocess
    import sys

    script = Path(SCRIPTS[0]).parent / "pretrain.py"
    command = [
        sys.executable,
        str(script),
        "--max_steps",
        "2",
        "--max_eval_samples",
        "8",
        "--output_dir",
        str(tmp_path),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    printed = done.stdout + done.stderr
    assert "validation perplexity:" in done.stdout
    noisy = [line for line in printed.splitlines() if any(word in line for word in NOISE)]
    assert not noisy, noisy


@pytest.mark.parametrize("name", ["pretrain.py", "finetune.py"])
def test_a_training_scripts_help_starts_with_one_usage_line_then_its_own_options(name):
    parser = load_module(Path(SCRIPTS[0]).parent / name).build_parser()
    lines = parser.format_help().splitlines()
    assert lines[0].startswith("usage: ") and lines[0].split()[2] == "[options]" and lines[1] == ""  # prog: argv[0]
    first_option = next(line.split()[0] for line in lines[3:] if line.startswith("  --"))
    training_fields = {f"--{field.name}" for field in dataclasses.fields(parser.dataclass_types[1])}
    assert first_option not in training_fields, first_option
