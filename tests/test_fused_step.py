"""Optimizer steps fused into the backward (`FusedStepOptimizer`, ``--fused_optimizer_step``). The reference is the
ordinary optimizer on a twin model, in float64: the same steps, merges, resets and schedule must give the same
parameters, and a resumed run must continue identically."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from models import tiny_llama
from peft import get_peft_model

from poet_hf import PoetConfig, PoetTrainingArguments, merge_and_reinit
from poet_hf.training import (
    FusedStepOptimizer,
    PoetTrainer,
    poet_param_groups,
    poet_parameters,
    reset_optimizer_state,
)
from poet_hf.training.fused_step import check_fused_step

ROOT = Path(__file__).resolve().parent.parent
BATCHES = [torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(i)) for i in range(5)]


def poet_model() -> torch.nn.Module:
    """A float64 POET LLaMA whose head also trains: skews and a full-rank parameter, in two rate groups."""
    model = get_peft_model(tiny_llama().double(), PoetConfig(block_size=16, init_weights=False))
    model.base_model.model.lm_head.weight.requires_grad_(True)
    return model


def train(model, optimizer, scheduler, batches, merge_after: int | None = None) -> list[torch.Tensor]:
    gradients_left = []
    for step, ids in enumerate(batches):
        model(input_ids=ids, labels=ids).loss.backward()
        gradients_left.append(sum(p.grad is not None for p in model.parameters()))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        if merge_after is not None and step == merge_after:
            merge_and_reinit(model)
            reset_optimizer_state(optimizer, poet_parameters(model))
    return gradients_left


def optimizers(model, fused: bool):
    groups = poet_param_groups(model, 1e-2, 3e-3, 0.01, ["base_model.model.lm_head.weight"])
    optimizer = FusedStepOptimizer(groups, torch.optim.AdamW) if fused else torch.optim.AdamW(groups)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    return optimizer, scheduler


def test_fused_steps_equal_the_ordinary_step_with_a_schedule_and_a_merge_in_float64():
    plain_model = poet_model()
    fused_model = copy.deepcopy(plain_model)
    train(plain_model, *optimizers(plain_model, False), BATCHES, merge_after=2)
    gradients_left = train(fused_model, *optimizers(fused_model, True), BATCHES, merge_after=2)
    assert gradients_left == [0] * len(BATCHES)  # every gradient was freed right after its step
    for (name, plain), fused in zip(plain_model.named_parameters(), fused_model.parameters(), strict=True):
        assert torch.equal(plain, fused), name  # the same per-parameter AdamW arithmetic, in the same order


def test_a_fused_optimizer_resumes_from_its_state_dict_exactly():
    model = poet_model()
    optimizer, scheduler = optimizers(model, True)
    train(model, optimizer, scheduler, BATCHES[:2])
    saved_model, saved = copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict())
    saved_scheduler = scheduler.state_dict()
    train(model, optimizer, scheduler, BATCHES[2:])

    resumed = poet_model()
    resumed.load_state_dict(saved_model)
    optimizer2, scheduler2 = optimizers(resumed, True)
    optimizer2.load_state_dict(saved)
    scheduler2.load_state_dict(saved_scheduler)
    train(resumed, optimizer2, scheduler2, BATCHES[2:])
    for (name, a), b in zip(model.named_parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize(
    ("settings", "processes", "sharded", "message"),
    [
        ({"max_grad_norm": 0, "fp16": True}, 1, False, r"cannot run with fp16 \(fp16=True\)"),
        ({}, 2, True, r"not built for FSDP2 \(world size 2\)"),
    ],
)
def test_settings_a_fused_step_cannot_honour_are_refused(tmp_path, settings, processes, sharded, message):
    args = PoetTrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True, **settings)
    with pytest.raises(ValueError, match=message):
        check_fused_step(args.fp16, processes, sharded)


def reference_clipped_steps(model, batches, threshold: float, order: list[list[int]]) -> None:
    """The clip of `FusedStepOptimizer` written out in float64 on a twin with an ordinary AdamW: all gradients first,
    then each parameter's scale from the global norm estimate in the order the backward reached them (``order``,
    recorded on the fused model): this step's squared norms of the parameters reached so far, the previous step's of
    the rest."""
    params = list(model.parameters())
    groups = poet_param_groups(model, 1e-2, 3e-3, 0.01, ["base_model.model.lm_head.weight"])
    optimizer = torch.optim.AdamW(groups)
    previous: dict[int, float] = {}
    for ids, reached in zip(batches, order, strict=True):
        model(input_ids=ids, labels=ids).loss.backward()
        current = {i: float(params[i].grad.double().pow(2).sum()) for i in reached}
        for position, i in enumerate(reached):
            known = {**previous, **{j: current[j] for j in reached[: position + 1]}}
            estimate = sum(known.values()) ** 0.5
            params[i].grad.mul_(min(1.0, threshold / (estimate + 1e-6)))
        optimizer.step()
        optimizer.zero_grad()
        previous = current


@pytest.mark.parametrize("threshold", [0.05, 1e9])
def test_the_fused_clip_is_the_running_global_norm_estimate_in_float64(threshold):
    """With ``max_grad_norm`` the fused steps clip against the global norm as the backward knows it; a threshold no
    norm reaches changes nothing. The last parameter reached is clipped by this step's exact global norm."""
    plain_model = poet_model()
    fused_model = copy.deepcopy(plain_model)
    params = list(fused_model.parameters())
    index = {p: i for i, p in enumerate(params)}
    order: list[list[int]] = [[] for _ in BATCHES]
    groups = poet_param_groups(fused_model, 1e-2, 3e-3, 0.01, ["base_model.model.lm_head.weight"])
    fused = FusedStepOptimizer(groups, torch.optim.AdamW, max_grad_norm=lambda: threshold)
    current = [0]  # the step the backward is in
    for p in params:  # registered after the optimizer's hooks: they run in the same order, once the step is done
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(lambda p: order[current[0]].append(index[p]))
    norms = []
    for step, ids in enumerate(BATCHES):
        current[0] = step
        fused_model(input_ids=ids, labels=ids).loss.backward()
        norms.append(fused.grad_norm)
        fused.step()
    reference_clipped_steps(plain_model, BATCHES, threshold, order)
    assert len(order[0]) == sum(p.requires_grad for p in params) and min(norms) > 10 * 0.05  # the clip acts
    for (name, expected), actual in zip(plain_model.named_parameters(), fused_model.parameters(), strict=True):
        torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-14, msg=name)


def test_the_trainer_logs_the_fused_steps_gradient_norm_and_clips_with_the_recipe(tmp_path):
    """``max_grad_norm`` stays on with fused steps: PoetTrainer logs the norm the backward measured (the float64
    norm of the same gradients an ordinary step clips), not the zero of the freed gradients."""
    ids = torch.randint(0, 128, (8, 16), generator=torch.Generator().manual_seed(1))
    data = Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})
    logged = {}
    for fused in (False, True):
        model = get_peft_model(tiny_llama(), PoetConfig(block_size=16))
        args = PoetTrainingArguments(
            output_dir=str(tmp_path / str(fused)),
            fused_optimizer_step=fused,
            max_grad_norm=1.0,
            max_steps=1,
            per_device_train_batch_size=8,
            logging_steps=1,
            report_to="none",
            use_cpu=True,
            disable_tqdm=True,
            seed=0,
        )
        trainer = PoetTrainer(model=model, args=args, train_dataset=data)
        trainer.train()
        logged[fused] = next(log["grad_norm"] for log in trainer.state.log_history if "grad_norm" in log)
    assert logged[True] > 0
    # the same first gradients; float32 norms summed in two orders: a relative gap of a few float32 roundings
    assert logged[True] == pytest.approx(logged[False], rel=1e-5)


def test_ddp_and_gradient_accumulation_are_allowed():
    check_fused_step(False, 2, False)  # DDP: the communication hook steps each bucket (test_training.py)


def test_poet_trainer_with_fused_steps_merges_checkpoints_and_resumes_identically(tmp_path):
    ids = torch.randint(0, 128, (24, 16), generator=torch.Generator().manual_seed(1))
    data = Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})

    def run(output_dir, max_steps, resume=None, fused=True, accumulation=1):
        model = get_peft_model(tiny_llama(), PoetConfig(block_size=16))
        args = PoetTrainingArguments(
            output_dir=str(output_dir),
            fused_optimizer_step=fused,
            max_grad_norm=0,
            max_steps=max_steps,
            merge_every=2,
            per_device_train_batch_size=4 // accumulation,
            gradient_accumulation_steps=accumulation,
            learning_rate=1e-3,
            poet_learning_rate=2e-3,
            lr_scheduler_type="cosine",
            save_strategy="steps",
            save_steps=3,
            report_to="none",
            use_cpu=True,
            disable_tqdm=True,
            seed=0,
        )
        trainer = PoetTrainer(model=model, args=args, train_dataset=data)
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    plain = run(tmp_path / "plain", 6, fused=False)
    whole = run(tmp_path / "whole", 6)
    assert isinstance(whole.optimizer.optimizer, FusedStepOptimizer)
    resumed = run(tmp_path / "whole", 6, resume=str(tmp_path / "whole" / "checkpoint-3"))
    for (name, a), b, c in zip(
        whole.model.named_parameters(), resumed.model.parameters(), plain.model.parameters(), strict=True
    ):
        assert torch.equal(a, b), name  # the resumed run continues the fused one identically
        # float32: the fused and the ordinary AdamW run the same single-tensor arithmetic per parameter
        assert torch.equal(a, c), name

    # Two micro-batches of 2: the first backward only accumulates, the second steps the sum, as the ordinary step does
    plain_accumulated = run(tmp_path / "plain2", 6, fused=False, accumulation=2)
    fused_accumulated = run(tmp_path / "fused2", 6, accumulation=2)
    for (name, a), b in zip(
        plain_accumulated.model.named_parameters(), fused_accumulated.model.parameters(), strict=True
    ):
        assert torch.equal(a, b), name


def test_the_pretraining_script_takes_fused_steps_and_names_what_it_needs(tmp_path, local_corpus):
    from script_modules import load_module

    script = load_module(ROOT / "scripts" / "pretrain.py")
    small = ["--per_device_train_batch_size", "2", "--global_batch_size", "2", "--seq_len", "64", "--max_steps", "2"]
    argv = [*small, "--max_eval_samples", "4", "--dataset", local_corpus, "--block_size", "32"]
    argv += ["--output_dir", str(tmp_path), "--fused_optimizer_step"]
    results = script.main(argv)  # the recipe's clip stays on
    assert results["recipe"]["max_grad_norm"] == 1.0 and results["recipe"]["fused_optimizer_step"]
    assert results["steps"] == 2 and all(torch.isfinite(torch.tensor(results["train_losses"])))


def row_chunk_steps(model, optimizer, batches) -> None:
    for ids in batches:
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def test_the_head_and_embeddings_step_in_row_chunks_with_the_whole_weights_arithmetic(monkeypatch):
    """Given the model, the fused optimizer trains the head and the input embeddings as row chunks (no gradient of
    either is ever whole); every row still steps at every step, tokens or not, so in float64 the parameters equal those
    of the ordinary AdamW on the whole weights, bit for bit. A resumed run continues identically."""
    from poet_hf.training import row_gradients

    monkeypatch.setattr(row_gradients, "ROW_CHUNK_ENTRIES", 1000)
    whole = poet_model()
    whole.base_model.model.model.embed_tokens.weight.requires_grad_(True)
    chunked, resumed = copy.deepcopy(whole), copy.deepcopy(whole)

    def optimizer(model, fused: bool):
        groups = poet_param_groups(model, 1e-2, 3e-3, 0.01, ["base_model.model.lm_head.weight"])
        return FusedStepOptimizer(groups, torch.optim.AdamW, model=model) if fused else torch.optim.AdamW(groups)

    row_chunk_steps(whole, optimizer(whole, False), BATCHES)
    fused = optimizer(chunked, True)
    row_chunk_steps(chunked, fused, BATCHES[:2])
    assert [len(c.chunks) for c in fused.row_gradients.chunked] == [8, 8]  # 16 rows of 64: 1024 entries each
    saved_model, saved = copy.deepcopy(chunked.state_dict()), copy.deepcopy(fused.state_dict())
    row_chunk_steps(chunked, fused, BATCHES[2:])
    fused.remove_hooks()
    assert chunked.base_model.model.lm_head.weight.requires_grad  # whole again
    resumed.load_state_dict(saved_model)
    again = optimizer(resumed, True)
    again.load_state_dict(saved)
    row_chunk_steps(resumed, again, BATCHES[2:])
    for (name, a), b, c in zip(whole.named_parameters(), chunked.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b), name
        assert torch.equal(a, c), name


@pytest.mark.parametrize("layer", ["embedding", "head"])
def test_row_chunks_of_whole_state_blocks_keep_bitsandbytes_8bit_steps_bit_for_bit(monkeypatch, layer):
    """bitsandbytes quantises 8-bit states in independent 256-entry blocks: chunks of whole blocks (4096 entries, its
    8-bit minimum) step as the whole weight does, for the same upstream gradients. After the first step no token
    reads the embedding's second chunk: its rows still move, by their momentum, as the whole weight's do."""
    import bitsandbytes

    from poet_hf.training import row_gradients

    monkeypatch.setattr(row_gradients, "ROW_CHUNK_ENTRIES", 4096)
    steps = [torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(0)) for vocab in (128, 64, 64)]
    hidden = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(1))

    def build() -> torch.nn.Module:
        torch.manual_seed(2)
        inner = torch.nn.Embedding(128, 64) if layer == "embedding" else torch.nn.Linear(64, 128, bias=False)
        return torch.nn.ModuleDict({"inner": inner})

    def loss(model, ids) -> torch.Tensor:
        out = model["inner"](ids if layer == "embedding" else hidden)
        return (out * torch.linspace(-1, 1, out.shape[-1])).square().sum()

    whole, chunked = build(), build()
    plain = bitsandbytes.optim.AdamW8bit(whole.parameters(), lr=1e-2)
    chunked.get_output_embeddings = lambda: chunked["inner"]  # type: ignore[method-assign]
    groups = [{"params": list(chunked.parameters())}]
    fused = FusedStepOptimizer(groups, bitsandbytes.optim.AdamW8bit, model=chunked, lr=1e-2)
    assert [len(c.chunks) for c in fused.row_gradients.chunked] == [2]
    for ids in steps:
        loss(whole, ids).backward()
        plain.step()
        plain.zero_grad()
        loss(chunked, ids).backward()
        fused.step()
    assert plain.state[whole["inner"].weight]["state1"].dtype == torch.uint8
    assert torch.equal(whole["inner"].weight, chunked["inner"].weight)


def test_an_optimizer_with_whole_tensor_statistics_keeps_the_head_and_embeddings_whole(monkeypatch):
    """Row chunks step as the whole weight only under an update entry by entry: Adafactor's row and column statistics
    and LAMB's trust ratio (a norm per tensor) would change, so those keep the weights whole."""
    import bitsandbytes
    from transformers.optimization import Adafactor

    from poet_hf.training import row_gradients

    monkeypatch.setattr(row_gradients, "ROW_CHUNK_ENTRIES", 1000)
    cases = [
        (torch.optim.AdamW, {}, True),
        (bitsandbytes.optim.AdamW8bit, {}, True),
        (bitsandbytes.optim.LAMB, {}, False),
        (Adafactor, {"lr": 1e-3, "relative_step": False}, False),
    ]
    for optimizer_cls, kwargs, chunked in cases:
        model = poet_model().float()
        groups = poet_param_groups(model, 1e-2, 3e-3, 0.01, ["base_model.model.lm_head.weight"])
        fused = FusedStepOptimizer(groups, optimizer_cls, model=model, **kwargs)
        assert (fused.row_gradients is not None) == chunked, optimizer_cls.__name__
        assert model.base_model.model.lm_head.weight.requires_grad != chunked
        fused.remove_hooks()
