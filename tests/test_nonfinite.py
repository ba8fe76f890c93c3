"""Non-finite steps named and survived (poet_hf.training.nonfinite): a NaN injected into the loss, into one layer's
gradient and into one skew vector is named (layer, side, step), its step changes nothing (parameters and optimizer
states equal, bit for bit, what they were before it), and the run finishes; K in a row stop the run with its last
checkpoint resuming as an uninterrupted run does."""

from __future__ import annotations

import logging

import pytest
import torch
from training_utils import state_hash, tiny_dataset, tiny_poet_model, tiny_trainer
from transformers import TrainerCallback

from poet_hf.training import PoetTrainer
from poet_hf.training.nonfinite import NonFiniteStepError
from poet_hf.tuners.rotation.layer import rotation_layers

BAD_STEP = 3  # merges every 2 steps: step 3 comes right after a merge, step 4 merges after it


@pytest.fixture(scope="module")
def data():
    return tiny_dataset()


def optimizer_states(trainer: PoetTrainer) -> dict[str, torch.Tensor]:
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    return {
        f"{names[id(p)]}.{key}": value.clone()
        for p, state in trainer.optimizer.state.items()
        for key, value in state.items()
        if torch.is_tensor(value)
    }


class Injection(TrainerCallback):
    """Injects a NaN at step ``BAD_STEP`` (``where``: "loss", "gradient" or "skew") and records the model and the
    optimizer's states just before and just after that step."""

    def __init__(self, where: str, steps: tuple[int, ...] = (BAD_STEP,)):
        self.where, self.steps = where, steps
        self.trainer: PoetTrainer | None = None
        self.before: tuple[dict, dict] | None = None
        self.after: tuple[dict, dict] | None = None
        self.handle = None

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        step = state.global_step + 1
        if step not in self.steps:
            return
        trainer = self.trainer
        self.before = ({k: v.clone() for k, v in model.state_dict().items()}, optimizer_states(trainer))
        name, layer = rotation_layers(model)[3]
        param = layer.poet_R["default"]
        if self.where == "skew":
            with torch.no_grad():
                param[0, 0] = float("nan")
        elif self.where == "gradient":
            self.handle = param.register_hook(lambda grad: torch.full_like(grad, float("nan")))
        self.layer_name = name

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step not in self.steps:
            return
        if self.handle is not None:
            self.handle.remove()
            self.handle = None
        self.after = ({k: v.clone() for k, v in model.state_dict().items()}, optimizer_states(self.trainer))


class NanLossTrainer(PoetTrainer):
    """Multiplies the training loss by NaN at the steps listed in ``nan_steps``."""

    nan_steps: tuple[int, ...] = ()

    def compute_loss(self, model, inputs, *args, **kwargs):
        loss = super().compute_loss(model, inputs, *args, **kwargs)
        if model.training and self.state.global_step + 1 in self.nan_steps:
            loss = loss * float("nan")
        return loss


def run(tmp_path, data, where: str, limit: int = 10, steps: tuple[int, ...] = (BAD_STEP,), **args):
    dataset, tokenizer = data
    model = tiny_poet_model(len(tokenizer))
    trainer = tiny_trainer(tmp_path, model, dataset, max_consecutive_nonfinite_steps=limit, **args)
    if where == "loss":
        trainer.__class__ = NanLossTrainer
        trainer.nan_steps = steps
    injection = Injection(where, steps)
    injection.trainer = trainer
    trainer.add_callback(injection)
    return trainer, injection


@pytest.mark.parametrize(
    "where, named",
    [
        ("loss", "the loss is not finite; every gradient is non-finite"),
        ("gradient", "non-finite gradients of {layer} (input rotation)"),
        ("skew", "non-finite values in {layer} (input rotation)"),
    ],
)
def test_a_nan_is_named_its_step_changes_nothing_and_the_run_finishes(tmp_path, data, caplog, where, named):
    trainer, injection = run(tmp_path, data, where)
    with caplog.at_level(logging.WARNING, logger="poet_hf.training.nonfinite"):
        trainer.train()
    assert trainer.state.global_step == 6 and trainer.nonfinite.skipped == [BAD_STEP]
    message = named.format(layer=injection.layer_name)
    assert f"step {BAD_STEP} skipped, nothing updated" in caplog.text and message in caplog.text
    (model_before, states_before), (model_after, states_after) = injection.before, injection.after
    if where == "skew":  # the NaN rotation is reset to the identity (zero skew), with its optimizer state
        key = next(k for k in model_before if injection.layer_name in k and "poet_R" in k)
        assert torch.equal(model_after[key], torch.zeros_like(model_after[key]))
        assert "reset to the identity" in caplog.text
        model_before = {k: v for k, v in model_before.items() if k != key}
        states_before = {k: v for k, v in states_before.items() if not (injection.layer_name in k and "poet_R" in k)}
    assert all(torch.equal(value, model_after[key]) for key, value in model_before.items())
    assert all(torch.equal(value, states_after[key]) for key, value in states_before.items())
    assert all(bool(torch.isfinite(p).all()) for p in trainer.model.parameters())


def test_k_nonfinite_steps_in_a_row_stop_the_run_and_its_last_checkpoint_resumes_identically(tmp_path, data):
    dataset, tokenizer = data
    checkpoints = {"save_strategy": "steps", "save_steps": 2}
    trainer, _ = run(tmp_path / "stopped", data, "loss", limit=2, steps=(3, 4, 5, 6), **checkpoints)
    with pytest.raises(NonFiniteStepError, match=r"2 non-finite steps in a row \(the last, step 4: the loss is not"):
        trainer.train()
    resumed = tiny_trainer(tmp_path / "stopped", tiny_poet_model(len(tokenizer), seed=1), dataset, **checkpoints)
    resumed.train(resume_from_checkpoint="auto")  # from checkpoint-2, with nothing injected
    reference = tiny_trainer(tmp_path / "reference", tiny_poet_model(len(tokenizer)), dataset, **checkpoints)
    reference.train()
    assert state_hash(resumed.model) == state_hash(reference.model)


def test_fused_steps_step_nothing_for_a_nonfinite_loss(tmp_path, data):
    trainer, injection = run(tmp_path, data, "loss", fused_optimizer_step=True)
    trainer.train()
    assert trainer.nonfinite.skipped == [BAD_STEP]
    (model_before, states_before), (model_after, states_after) = injection.before, injection.after
    assert all(torch.equal(value, model_after[key]) for key, value in model_before.items())
    assert all(torch.equal(value, states_after[key]) for key, value in states_before.items())


def test_fused_steps_leave_a_parameter_with_a_nonfinite_gradient_unstepped(tmp_path, data, caplog):
    trainer, injection = run(tmp_path, data, "gradient", fused_optimizer_step=True)
    with caplog.at_level(logging.WARNING, logger="poet_hf.training.nonfinite"):
        trainer.train()
    assert trainer.nonfinite.skipped == [BAD_STEP] and injection.layer_name in caplog.text
    key = next(k for k in injection.before[0] if injection.layer_name in k and "poet_R" in k)
    assert torch.equal(injection.before[0][key], injection.after[0][key])  # that one parameter did not step
