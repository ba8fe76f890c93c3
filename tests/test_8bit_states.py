"""8-bit optimizer states (bitsandbytes' AdamW8bit, ``--optim adamw_bnb_8bit``; torchao's, ``--optim
adamw_torch_8bit``) with POET's two rates and the reset at merges. The reference for a reset state is a fresh
optimizer: after a reset, the same gradients must give the same parameters, bit for bit."""

from __future__ import annotations

import bitsandbytes as bnb
import pytest
import torch
from datasets import Dataset
from models import tiny_llama
from peft import get_peft_model

from poet_hf import PoetConfig, PoetTrainingArguments
from poet_hf.training import PoetTrainer, create_poet_optimizer, poet_parameters, reset_optimizer_state


def bnb_adamw_8bit(params):
    return bnb.optim.AdamW8bit(params, lr=1e-2, min_8bit_size=0)


def torchao_adamw_8bit(params):
    from torchao.optim import AdamW8bit

    return AdamW8bit(params, lr=1e-2)


@pytest.mark.parametrize("make", [bnb_adamw_8bit, torchao_adamw_8bit], ids=["bitsandbytes", "torchao"])
def test_a_reset_8bit_state_steps_exactly_like_a_fresh_optimizer(make):
    generator = torch.Generator().manual_seed(0)
    param = torch.nn.Parameter(torch.randn(64, 300, generator=generator))
    optimizer = make([param])
    for _ in range(3):
        param.grad = torch.randn(param.shape, generator=generator)
        optimizer.step()
    assert int(optimizer.state[param]["step"]) == 3
    assert reset_optimizer_state(optimizer, [param]) == 1
    twin = torch.nn.Parameter(param.detach().clone())
    fresh = make([twin])
    for _ in range(3):
        gradient = torch.randn(param.shape, generator=generator)
        param.grad, twin.grad = gradient.clone(), gradient.clone()
        optimizer.step()
        fresh.step()
    assert torch.equal(param, twin)
    for key, value in fresh.state[twin].items():  # codes, scales and maps (bitsandbytes), step
        if type(value) is torch.Tensor or not torch.is_tensor(value):
            assert torch.equal(torch.as_tensor(optimizer.state[param][key]), torch.as_tensor(value)), key


def test_the_trainer_with_adamw_bnb_8bit_keeps_two_rates_and_resets_the_states_at_a_merge(tmp_path):
    ids = torch.randint(0, 128, (16, 16), generator=torch.Generator().manual_seed(1))
    data = Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})

    def trainer(optim: str) -> PoetTrainer:
        # 128-blocks on the 128-wide sides: 8128 skew entries per side, above bitsandbytes' 8-bit threshold (4096).
        model = get_peft_model(tiny_llama(hidden=128, intermediate=256), PoetConfig(block_size=128))
        arguments = PoetTrainingArguments(
            output_dir=str(tmp_path / optim),
            optim=optim,
            max_steps=3,
            merge_every=2,
            per_device_train_batch_size=4,
            learning_rate=1e-3,
            poet_learning_rate=5e-4,
            report_to="none",
            use_cpu=True,
            save_strategy="no",
            disable_tqdm=True,
        )
        return PoetTrainer(model=model, args=arguments, train_dataset=data)

    reference, eight_bit = trainer("adamw_torch"), trainer("adamw_bnb_8bit")
    groups = [create_poet_optimizer(t.model, t.args).param_groups for t in (reference, eight_bit)]
    assert [(g["lr"], len(g["params"])) for g in groups[0]] == [(g["lr"], len(g["params"])) for g in groups[1]]
    assert {g["lr"] for g in groups[1]} >= {5e-4}  # the rotation rate, as PoetTrainer's
    output = eight_bit.train()
    assert torch.isfinite(torch.tensor(output.training_loss))
    states = [eight_bit.optimizer.state[p] for p in poet_parameters(eight_bit.model)]
    assert any(s["state1"].dtype == torch.uint8 for s in states)  # 8-bit states exist for the large skews
    assert all(s["step"] == 1 for s in states)  # reset at the merge after step 2, then one step
    qmap = bnb.functional.create_dynamic_map(signed=True)
    assert all(torch.equal(s["qmap1"], qmap) for s in states if "qmap1" in s)  # the quantisation maps survive
