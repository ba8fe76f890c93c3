"""`--suite pretrain_quality`: each method's command line is the run it names, with its swept rate where that method
reads it."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

from benchmarks.suites import pretrain_quality
from poet_hf.recipes.pretrain import parse_pretrain_arguments, recipe_flags, resolve_recipe

# what each method must train with: the optimizer transformers runs and the recipe field its swept rate sets
EXPECTED = {
    "POET-BS": ("poet-bs", "adamw_torch_fused", "poet_learning_rate"),
    "POET-FS": ("poet-fs", "adamw_torch_fused", "poet_learning_rate"),
    "AdamW": ("adamw", "adamw_torch_fused", "learning_rate"),
    "AdamW 8-bit": ("adamw", "adamw_bnb_8bit", "learning_rate"),
    "GaLore 8-bit, layer-wise": ("galore", "galore_adamw_8bit_layerwise", "learning_rate"),
    "APOLLO-Mini, layer-wise": ("adamw", "apollo_adamw_layerwise", "learning_rate"),
    pretrain_quality.SAVINGS: ("poet-bs", "adamw_bnb_8bit", "poet_learning_rate"),
}


@pytest.mark.parametrize("method", list(EXPECTED))
def test_each_method_runs_what_it_names_at_the_swept_rate(tmp_path: Path, method: str) -> None:
    if method.startswith("GaLore") and importlib.util.find_spec("galore_torch") is None:
        pytest.skip("galore-torch (the [bench] extra) is not installed")
    rate = 1.234e-3  # on no grid: it can only come from the command line
    argv = pretrain_quality.job_argv(method, rate, quick=False)
    args, training = parse_pretrain_arguments([*argv, "--output_dir", str(tmp_path)])
    recipe = resolve_recipe(args, recipe_flags(training), world_size=1, vocab_size=4096).as_dict()
    expected_method, optimizer, rate_field = EXPECTED[method]
    assert (recipe["method"], recipe["optimizer"], recipe[rate_field]) == (expected_method, optimizer, rate)
    if rate_field == "poet_learning_rate":  # the embeddings and head keep the preset's rate
        assert recipe["learning_rate"] == 5e-3
    assert recipe["steps"] == pretrain_quality.STEPS and training.eval_steps == pretrain_quality.EVAL_STEPS
    assert recipe["fused_optimizer_step"] is (method == pretrain_quality.SAVINGS)


@pytest.mark.parametrize("method", list(EXPECTED))
def test_each_grid_doubles_from_the_presets_rate_and_steps_once_past_an_edge(method: str) -> None:
    preset = 4e-3 if method.startswith("POET") else 5e-3  # the tiny preset's rotation rate and learning rate
    grid = pretrain_quality.rates(method)
    assert set(grid) >= {preset / 2, preset, preset * 2}
    past = sorted(set(grid) - {preset / 2, preset, preset * 2}, key=lambda rate: abs(math.log2(rate / preset)))
    assert len(past) == len(pretrain_quality.PAST_THE_EDGE.get(method, ()))
    for doublings, rate in enumerate(past, start=2):  # each one doubling further past the same edge
        assert math.isclose(rate, preset * 2.0 ** (doublings * math.copysign(1, math.log2(past[0] / preset))))
    assert pretrain_quality.preset_rates(method)[1] == preset  # what --quick runs
