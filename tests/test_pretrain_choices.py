"""`--suite pretrain_choices`: each variant's command line is POET-FS with exactly its one choice changed."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.suites import pretrain_choices
from poet_hf.recipes.pretrain import parse_pretrain_arguments, recipe_flags, resolve_recipe

# the choice each variant changes from the reference: n, T_m, and the R (input) : P (output) budgets
REFERENCE = {"neumann_terms": 6, "paper_neumann_k": 4, "merge_every": 200, "budget": 0.5}
EXPECTED = {
    pretrain_choices.REFERENCE: {},
    "n = 5 (k = 3)": {"neumann_terms": 5, "paper_neumann_k": 3},
    "T_m = 50 (the tiny preset's)": {"merge_every": 50},
    "T_m = 400": {"merge_every": 400},
    "R-heavy split, ¾ : ¼": {"budget": {"input": 0.75, "output": 0.25}},
    "P-heavy split, ¼ : ¾": {"budget": {"input": 0.25, "output": 0.75}},
}


@pytest.mark.parametrize("variant", list(EXPECTED))
def test_each_variant_is_the_reference_with_its_one_choice_changed(tmp_path: Path, variant: str) -> None:
    argv = pretrain_choices.job_argv(pretrain_choices.VARIANTS[variant], quick=False)
    args, training = parse_pretrain_arguments([*argv, "--output_dir", str(tmp_path)])
    recipe = resolve_recipe(args, recipe_flags(training), world_size=1, vocab_size=4096).as_dict()
    assert {key: recipe[key] for key in REFERENCE} == REFERENCE | EXPECTED[variant]
    assert (recipe["method"], recipe["spo"], recipe["steps"]) == ("poet-fs", "full", pretrain_choices.STEPS)
    assert (recipe["learning_rate"], recipe["poet_learning_rate"]) == (5e-3, 4e-3)  # the tiny preset's rates
