"""The names of the last release still work for one more, each with a ``FutureWarning`` naming its replacement."""

from __future__ import annotations

import importlib
import sys

import pytest
import torch
from models import tiny_llama
from peft import get_peft_model

import poet_hf
from poet_hf import PoetConfig
from poet_hf.diagnostics import paper_metrics, rotation_angle, rotation_stats
from poet_hf.tuners.rotation.layer import rotation_layers


@pytest.fixture
def layer():
    model = get_peft_model(tiny_llama(), PoetConfig(block_size=8, init_weights=False))
    return rotation_layers(model)[0][1]


def test_the_orthogonal_tuner_package_keeps_its_old_name():
    sys.modules.pop("poet_hf.tuners.orthogonal", None)
    with pytest.warns(FutureWarning, match="poet_hf.tuners.orthogonal_layers"):
        old = importlib.import_module("poet_hf.tuners.orthogonal")
    assert old.OrthogonalConfig is poet_hf.OrthogonalConfig
    from poet_hf.tuners.orthogonal.layer import OrthogonalLayer  # a submodule of the old name

    assert OrthogonalLayer is importlib.import_module("poet_hf.tuners.orthogonal_layers").OrthogonalLayer


def test_poet_layers_is_rotation_layers():
    from poet_hf.tuners.poet import poet_layers

    model = get_peft_model(tiny_llama(), poet_hf.OftConfig(block_size=8))
    with pytest.warns(FutureWarning, match="rotation_layers"):
        old = poet_layers(model)
    assert [name for name, _ in old] == [name for name, _ in rotation_layers(model)] and old


def test_the_layer_settings_keep_their_old_names(layer):
    with pytest.warns(FutureWarning, match="rotation_specs"):
        assert layer.poet_specs is layer.rotation_specs
    with pytest.warns(FutureWarning, match="rotation_settings"):
        assert layer.poet_settings is layer.rotation_settings


def test_the_layer_statistics_methods_give_what_the_diagnostics_give(layer):
    with pytest.warns(FutureWarning, match="poet_hf.diagnostics.rotation_stats"):
        assert layer.rotation_stats("default") == rotation_stats(layer)
    with pytest.warns(FutureWarning, match="poet_hf.diagnostics.paper_metrics"):
        assert layer.paper_metrics("default") == paper_metrics(layer)
    with pytest.warns(FutureWarning, match="poet_hf.diagnostics.rotation_angle"):
        assert layer.rotation_angle("default") == rotation_angle(layer)


def test_a_merge_interval_given_to_the_callback_warns_and_still_sets_the_interval():
    from poet_hf.training import MergeReinitCallback

    with pytest.warns(FutureWarning, match="adapter config"):
        callback = MergeReinitCallback(merge_every=6)
    model = get_peft_model(tiny_llama(), PoetConfig(block_size=8, merge_every=400))
    args = poet_hf.PoetTrainingArguments(output_dir="unused", report_to="none", use_cpu=True)
    assert callback.interval(args, model) == 6
    with pytest.warns(FutureWarning, match="adapter config"):
        by_position = MergeReinitCallback(6)  # the former first argument
    assert by_position.interval(args, model) == 6 and by_position.adapter_name == "default"


def test_the_merge_interval_comes_from_the_config_unless_the_run_overrides_it():
    from poet_hf.training.callback import merge_interval

    model = get_peft_model(tiny_llama(), PoetConfig(block_size=8, merge_every=30))
    plain = poet_hf.PoetTrainingArguments(output_dir="unused", report_to="none", use_cpu=True)
    override = poet_hf.PoetTrainingArguments(output_dir="unused", report_to="none", use_cpu=True, merge_every=7)
    assert merge_interval(model, plain) == 30 and merge_interval(model, override) == 7
    assert merge_interval(torch.nn.Linear(2, 2), plain) is None  # no rotation layers: no merges


MOVED = [("poet_hf.tuners", old, new) for old, new in sorted(poet_hf.tuners.MOVED_MODULES.items())] + [
    ("poet_hf", old, new) for old, new in sorted(poet_hf.MOVED_MODULES.items())
]


@pytest.mark.parametrize("package, old, new", MOVED, ids=[f"{p}.{o}" for p, o, _ in MOVED])
def test_a_module_that_moved_still_imports_under_its_old_name(package: str, old: str, new: str):
    old_name, new_name = f"{package}.{old}", f"{package}.{new}"
    sys.modules.pop(old_name, None)
    with pytest.warns(FutureWarning, match=new_name.replace(".", r"\.")):
        module = importlib.import_module(old_name)
    assert module is importlib.import_module(new_name)


def test_a_module_under_an_old_package_name_is_the_moved_module_not_a_second_copy():
    from poet_hf.orthogonal import FeedbackGD

    for name in ("poet_hf.optim", "poet_hf.optim.feedback_gd"):
        sys.modules.pop(name, None)
    with pytest.warns(FutureWarning):
        from poet_hf.optim.feedback_gd import FeedbackGD as old_class
    assert old_class is FeedbackGD


def test_the_scripts_options_still_import_from_the_training_arguments():
    from poet_hf.recipes.script_arguments import ScriptArguments
    from poet_hf.training import arguments

    with pytest.warns(FutureWarning, match=r"poet_hf\.recipes\.script_arguments\.ScriptArguments"):
        assert arguments.ScriptArguments is ScriptArguments
