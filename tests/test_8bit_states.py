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


@pytest.mark.parametrize("make", [bnb_adamw_8bit, torchao_adamw_8bit], ids=["bitsandbytes", "torchao"])
def test_8bit_states_fused_into_the_backward_step_like_the_unfused_8bit_optimizer(make):
    """8-bit states with the steps fused into the backward (issue 42, items 2 and 3): the per-parameter 8-bit
    optimizers of `FusedStepOptimizer` give, bit for bit, the parameters of one grouped 8-bit optimizer stepping after
    the backward, through a merge and the reset of the rotations' states; the skews and the trainable embeddings and
    head all keep 8-bit states (bitsandbytes), and no gradient is left after a backward."""
    import copy

    from poet_hf import merge_and_reinit
    from poet_hf.training import FusedStepOptimizer, poet_param_groups

    def model_and_optimizer(fused: bool):
        model = get_peft_model(tiny_llama(hidden=128, intermediate=256), PoetConfig(block_size=32, init_weights=False))
        full = ["base_model.model.lm_head.weight", "base_model.model.model.embed_tokens.weight"]
        for name, param in model.named_parameters():
            param.requires_grad_(param.requires_grad or name in full)
        groups = poet_param_groups(model, 1e-3, 5e-4, 0.01, full)
        inner = type(make([torch.nn.Parameter(torch.zeros(1))]))
        kwargs = {"min_8bit_size": 0} if make is bnb_adamw_8bit else {}
        return model, FusedStepOptimizer(groups, inner, **kwargs) if fused else inner(groups, **kwargs)

    plain, plain_optimizer = model_and_optimizer(False)
    fused, fused_optimizer = model_and_optimizer(True)
    fused.load_state_dict(copy.deepcopy(plain.state_dict()))
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(4))
    for step in range(4):
        for model, optimizer in ((plain, plain_optimizer), (fused, fused_optimizer)):
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if step == 1:
                merge_and_reinit(model)
                reset_optimizer_state(optimizer, poet_parameters(model))
        assert all(p.grad is None for p in fused.parameters())
    for (name, expected), actual in zip(plain.named_parameters(), fused.parameters(), strict=True):
        assert torch.equal(expected, actual), name
    if make is bnb_adamw_8bit:  # torchao quantises only tensors of 4096+ entries in whole blocks of 256
        trainable = [p for p in fused.parameters() if p.requires_grad]
        eight_bit = [p for p in trainable if fused_optimizer.state[p]["state1"].dtype == torch.uint8]
        assert len(eight_bit) == len([p for p in trainable if p.dim() > 1])  # every matrix, the skews included


def test_a_chunked_cpu_8bit_step_gives_the_bits_of_the_whole_tensor_step(monkeypatch):
    """bitsandbytes' CPU kernel updated a chunk of whole 256-entry blocks at a time (`chunked_cpu_updates`, what the
    fused steps use) equals its update of the whole tensor, bit for bit: parameter, codes and block scales; the
    tensor's 12000 entries end in a partial block and a partial chunk. Its 32-bit update likewise."""
    from poet_hf.training.eight_bit import chunked_cpu_updates

    generator = torch.Generator().manual_seed(7)
    whole = torch.nn.Parameter(torch.randn(40, 300, generator=generator))
    chunked = torch.nn.Parameter(whole.detach().clone())
    optimizers = bnb_adamw_8bit([whole]), bnb_adamw_8bit([chunked])
    for _ in range(3):
        gradient = torch.randn(whole.shape, generator=generator)
        whole.grad, chunked.grad = gradient.clone(), gradient.clone()
        optimizers[0].step()
        with chunked_cpu_updates(chunk=1024):
            optimizers[1].step()
    assert torch.equal(whole, chunked)
    for key in ("state1", "state2", "absmax1", "absmax2"):
        assert torch.equal(optimizers[0].state[whole][key], optimizers[1].state[chunked][key]), key
    calls = []
    kernel = bnb.functional.optimizer_update_32bit
    monkeypatch.setattr(bnb.functional, "optimizer_update_32bit", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    thirty_two = [torch.nn.Parameter(whole.detach().clone()) for _ in range(2)]
    optimizers = [bnb.optim.AdamW32bit([p], lr=1e-2) for p in thirty_two]
    for _ in range(3):  # 32-bit states (the embeddings'), chunked entry by entry
        gradient = torch.randn(whole.shape, generator=generator)
        thirty_two[0].grad, thirty_two[1].grad = gradient.clone(), gradient.clone()
        optimizers[0].step()
        with chunked_cpu_updates(chunk=1024):
            optimizers[1].step()
    assert len(calls) == 3 * (1 + 12)  # per step: the whole tensor once, then 12 chunks of at most 1024 entries
    assert optimizers[1].state[thirty_two[1]]["state1"].dtype == torch.float32
    assert torch.equal(thirty_two[0], thirty_two[1])
    for key in ("state1", "state2"):
        assert torch.equal(optimizers[0].state[thirty_two[0]][key], optimizers[1].state[thirty_two[1]][key]), key
    with pytest.raises(ValueError, match="`chunk` must be a multiple of 256"):
        with chunked_cpu_updates(chunk=1000):
            pass


@pytest.fixture
def bitsandbytes_overrides_restored():
    """bitsandbytes' process-wide override tables as they were before the test (a ``Trainer`` writes into them)."""
    manager = bnb.optim.GlobalOptimManager.get_instance()
    tables = manager.module_weight_config_triple, manager.index2config, manager.pid2config
    saved = [table.copy() for table in tables]
    yield
    for table, before in zip(tables, saved, strict=True):
        table.clear()
        table.extend(before) if isinstance(table, list) else table.update(before)


@pytest.mark.parametrize("fused", [False, True], ids=["grouped", "fused"])
@pytest.mark.parametrize("hidden", [128, 256])
@pytest.mark.usefixtures("bitsandbytes_overrides_restored")
def test_embeddings_and_a_head_narrower_than_a_state_block_keep_32bit_states(tmp_path, fused, hidden):
    """Under ``adamw_bnb_8bit`` the embeddings keep 32-bit states as ``Trainer``'s optimizer keeps them (the reference,
    built and stepped first on a twin), the head keeps 32-bit states when its rows (``hidden`` wide) are not a whole
    number of bitsandbytes' 256-entry state blocks and 8-bit ones when they are, and the skews keep 8-bit states,
    grouped or fused. The Trainer's override is kept by position, process-wide, in bitsandbytes: it must not reach
    the (0, 0) parameter of POET's optimizers."""
    from transformers import Trainer, TrainingArguments

    def build() -> torch.nn.Module:
        config = PoetConfig(block_size=128, train_other_params=True, init_weights=False)
        return get_peft_model(tiny_llama(hidden=hidden, intermediate=256), config)

    args = TrainingArguments(output_dir=str(tmp_path), optim="adamw_bnb_8bit", use_cpu=True, report_to="none")
    args.fused_optimizer_step = fused
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(2))
    theirs, ours = build(), build()
    reference = Trainer(model=theirs, args=args).create_optimizer()
    optimizers = reference, create_poet_optimizer(ours, args, fused_step=fused)
    for model, optimizer in zip((theirs, ours), optimizers, strict=True):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()

    def state_dtypes(model, optimizer) -> dict[str, torch.dtype]:
        return {name: optimizer.state[p]["state1"].dtype for name, p in model.named_parameters() if p.requires_grad}

    expected, actual = state_dtypes(theirs, reference), state_dtypes(ours, optimizers[1])
    embedding, head = "base_model.model.model.embed_tokens.weight", "base_model.model.lm_head.weight"
    assert actual[embedding] == expected[embedding] == torch.float32
    assert expected[head] == torch.uint8
    assert actual[head] == (torch.float32 if hidden % 256 else torch.uint8)
    assert all(actual[name] == torch.uint8 for name in actual if "poet_" in name)
