"""The chunked causal-LM loss (poet_hf.training.chunked_loss) against the loss on the whole logits.

References: ``torch.nn.functional.cross_entropy`` of the whole float64 logits and autograd's gradients through it;
transformers' own causal-LM loss of a real (tiny) Llama."""

from __future__ import annotations

import json
from pathlib import Path

import prewarmed
import pytest
import torch
import torch.nn.functional as F
from tolerances import gamma

from poet_hf.training.chunked_loss import IGNORE_INDEX, causal_lm_loss, linear_cross_entropy


def _problem(dtype: torch.dtype, bias: bool):
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(37, 16, generator=generator, dtype=dtype, requires_grad=True)
    weight = torch.randn(50, 16, generator=generator, dtype=dtype, requires_grad=True)
    offset = torch.randn(50, generator=generator, dtype=dtype, requires_grad=True) if bias else None
    labels = torch.randint(0, 50, (37,), generator=generator)
    labels[[3, 17, 18]] = IGNORE_INDEX
    return hidden, weight, offset, labels


def _reference(hidden, weight, offset, labels, num_items=None):
    """The loss of the whole float64 logits and its gradients (autograd)."""
    tensors = (hidden, weight) + ((offset,) if offset is not None else ())
    leaves = [t.detach().double().requires_grad_() for t in tensors]
    logits = leaves[0] @ leaves[1].T + (leaves[2] if offset is not None else 0)
    reduction = "mean" if num_items is None else "sum"
    loss = F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction=reduction)
    loss = loss if num_items is None else loss / num_items
    loss.backward()
    return loss.detach(), [leaf.grad for leaf in leaves]


@pytest.mark.parametrize("chunk", [1, 5, 37, 100])
@pytest.mark.parametrize("bias", [False, True])
def test_float64_chunks_give_the_whole_logits_loss_and_gradients_to_rounding(chunk, bias):
    hidden, weight, offset, labels = _problem(torch.float64, bias)
    loss = linear_cross_entropy(hidden, weight, labels, offset, chunk_tokens=chunk)
    (loss * 3).backward()  # the incoming gradient scales every gradient
    expected, grads = _reference(hidden, weight, offset, labels)
    tolerance = 4 * gamma(64, torch.float64)  # sums of ≤ 50 logits or ≤ 37 tokens, in another order
    assert abs(float(loss) - float(expected)) <= tolerance * float(expected)
    for mine, theirs in zip([hidden.grad, weight.grad] + ([offset.grad] if bias else []), grads, strict=True):
        assert (mine - 3 * theirs).abs().max() <= tolerance * theirs.abs().max() * 3


def test_float32_chunks_are_within_float32_rounding_of_the_float64_loss():
    """Float32 inputs: each logit is a 16-term dot product, the softmax sums 50 terms and a gradient entry sums up to
    37 tokens; the chunked result is within those float32 roundings of the exact one."""
    hidden, weight, _, labels = _problem(torch.float32, False)
    loss = linear_cross_entropy(hidden, weight, labels, chunk_tokens=8, num_items_in_batch=40)
    loss.backward()
    expected, grads = _reference(hidden, weight, None, labels, num_items=40)
    bound = gamma(16 + 50 + 37, torch.float32)
    magnitude = float((hidden.detach().abs() @ weight.detach().abs().T).max())  # the logits' scale
    assert abs(float(loss) - float(expected)) <= bound * magnitude
    for mine, theirs in zip([hidden.grad, weight.grad], grads, strict=True):
        assert (mine.double() - theirs).abs().max() <= bound * magnitude * theirs.abs().max()


def test_without_gradients_it_only_sums_and_a_bad_chunk_is_refused():
    hidden, weight, _, labels = _problem(torch.float64, False)
    with torch.no_grad():
        loss = linear_cross_entropy(hidden, weight, labels, chunk_tokens=4)
    assert float(loss) == pytest.approx(float(_reference(hidden, weight, None, labels)[0]), rel=1e-12)
    with pytest.raises(ValueError, match="`loss_chunk_tokens` must be an integer >= 1, got 0"):
        linear_cross_entropy(hidden, weight, labels, chunk_tokens=0)


def test_a_causal_lm_gives_the_whole_logits_loss_and_gradients():
    """A tiny Llama in float64: the chunked loss through its decoder and head equals the shifted cross-entropy of its
    whole logits in float64 (transformers' own loss casts them to float32), and so do every parameter's gradients."""
    from models import tiny_llama

    torch.manual_seed(0)
    model = tiny_llama(0, hidden=32, intermediate=64, vocab=96, heads=2, max_position_embeddings=64).double()
    ids = torch.randint(0, 96, (3, 20))
    labels = ids.clone()
    labels[0, :5] = IGNORE_INDEX
    logits = model(input_ids=ids).logits[:, :-1]
    expected = F.cross_entropy(logits.reshape(-1, 96), labels[:, 1:].reshape(-1), ignore_index=IGNORE_INDEX)
    expected.backward()
    reference = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    loss = causal_lm_loss(model, {"input_ids": ids, "labels": labels}, chunk_tokens=7)
    loss.backward()
    assert float(loss) == pytest.approx(float(expected), rel=1e-12)
    for name, parameter in model.named_parameters():
        scale = reference[name].abs().max()
        assert (parameter.grad - reference[name]).abs().max() <= 1e-12 * max(float(scale), 1e-300), name


def test_poet_trainer_with_loss_chunk_tokens_trains_as_with_the_whole_logits(tmp_path, monkeypatch):
    """The same tiny POET run, 3 steps with a merge after the second, through ``PoetTrainer``: the chunked loss logs
    transformers' losses and ends at the same weights, to float32 rounding carried by 3 steps."""
    from training_utils import tiny_dataset, tiny_poet_model, tiny_trainer

    import poet_hf.training.chunked_loss as chunked_loss

    calls = []
    original = chunked_loss.linear_cross_entropy
    monkeypatch.setattr(chunked_loss, "linear_cross_entropy", lambda *a, **k: calls.append(1) or original(*a, **k))

    dataset, tokenizer = tiny_dataset()
    runs = {}
    for chunk in (None, 24):
        model = tiny_poet_model(len(tokenizer))
        trainer = tiny_trainer(tmp_path / str(chunk), model, dataset, max_steps=3, loss_chunk_tokens=chunk)
        trainer.train()
        losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
        runs[chunk] = losses, {n: p.detach().clone() for n, p in model.named_parameters()}
    (whole, whole_state), (chunked, chunked_state) = runs[None], runs[24]
    assert len(whole) == 3 and chunked == pytest.approx(whole, rel=1e-5)
    assert len(calls) == 3  # one chunked loss per step of the second run
    for name, value in whole_state.items():
        assert (chunked_state[name] - value).abs().max() <= 1e-4 * max(float(value.abs().max()), 1.0), name


def test_fused_steps_refuse_the_chunked_loss(tmp_path):
    from poet_hf.training import PoetTrainingArguments

    with pytest.raises(ValueError, match="`loss_chunk_tokens` holds the head's whole gradient"):
        PoetTrainingArguments(output_dir=str(tmp_path), loss_chunk_tokens=64, fused_optimizer_step=True)
    with pytest.raises(ValueError, match="`loss_chunk_tokens` must be an integer >= 1, got 0"):
        PoetTrainingArguments(output_dir=str(tmp_path), loss_chunk_tokens=0)


def test_a_sharded_head_s_loss_and_embedding_lookup_in_two_processes_equal_the_dense_ones_in_float64(tmp_path):
    """tests/workers/sharded_head_worker.py: FSDP2's head split 6 + 5 rows, 7 and 5 tokens (steps of 2 rows a process,
    rank 1 padded): each process's loss and hidden gradient are the dense float64 ones, the gathered head gradient
    the mean of the two processes' dense ones, to float64 rounding (γ₆₄: each entry a sum of under 20 terms); losses
    scaled differently are refused, since each head shard sums every process's tokens. The sharded embedding lookup
    (the same table, padding row 3, 3 positions at a time): each process's embeddings equal ``F.embedding``'s on the
    whole table exactly (one row plus zeros), the table's gradient the mean of the dense ones to γ₆₄, its padding
    row zero."""
    worker = Path(__file__).resolve().parent / "workers" / "sharded_head_worker.py"
    prewarmed.run(worker, [tmp_path], tmp_path / "worker.log", ranks=2, torchrun=True)
    bound = gamma(64, torch.float64)
    for rank in range(2):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for case in ("own counts", "shared count"):
            errors = report[case]
            assert max(errors["loss"], errors["hidden"], errors["head"]) <= bound, (rank, case, errors)
            assert errors["head_scale"] > 0.1, (rank, case, errors)  # the head's gradient is not vanishingly small
        assert "each process must scale its loss alike; got the scales [1.0, 2.0]" in report["unequal scales"]
        lookup = report["lookup"]
        assert lookup["output"] == 0 and lookup["padding_row"] == 0, (rank, lookup)
        assert lookup["table"] <= bound and lookup["table_scale"] > 0.1, (rank, lookup)


def test_the_plan_holds_one_chunk_of_logits():
    """At 4096 tokens and Llama-3's 128,256-entry vocabulary, in bfloat16, the loss holds one 512-token chunk of
    float32 logits with their bfloat16 copy, and the hidden states' gradient: under 600 MiB, where the whole logits'
    backward holds two float32 gradients of them (4008 MiB; measured below)."""
    from transformers import LlamaConfig

    from poet_hf.recipes.memory_plan import plan_memory

    config = LlamaConfig(
        vocab_size=128256, hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=8
    )
    common = {"method": "adamw", "batch_size": 1, "seq_len": 4096, "dtype": "bfloat16", "checkpointing": True}
    whole = plan_memory(config, **common).parts["loss working set"]
    chunked = plan_memory(config, **common, loss_chunk_tokens=512).parts["loss working set"]
    assert whole == 2 * 4096 * 128256 * 4 and chunked == 512 * 128256 * (4 + 2) + 4096 * 512 * 2
    assert chunked <= 600 * 2**20 < whole
    with pytest.raises(ValueError, match="`loss_chunk_tokens` must be an integer >= 1, got 0"):
        plan_memory(config, **common, loss_chunk_tokens=0)


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc/self/clear_refs")
def test_the_whole_loss_working_set_is_what_its_backward_holds():
    """The planner's working set of transformers' loss against the kernel's own count: the peak RSS (``VmHWM``,
    restarted by ``clear_refs``) of its backward above the RSS it starts from, glibc's mmap threshold fixed so that
    each gradient is its own mapping. One logits-sized gradient (the old count) is half of it."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    from benchmarks.common import reset_peak_rss, status_mb
    from poet_hf.allocator import bound_allocator_slack
    from poet_hf.recipes.plan_parts import loss_bytes
    from poet_hf.recipes.plan_settings import PlanSettings

    if not bound_allocator_slack():
        pytest.skip("glibc's mmap threshold cannot be fixed here")
    batch, seq, vocabulary = 1, 512, 32000
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(batch, seq, vocabulary, generator=generator, requires_grad=True)
    labels = torch.randint(0, vocabulary, (batch, seq), generator=generator)
    loss = ForCausalLMLoss(logits, labels, vocabulary)
    reset_peak_rss()
    start = status_mb("VmRSS")
    loss.backward()
    measured = (status_mb("VmHWM") - start) * 2**20
    planned = loss_bytes(PlanSettings(method="adamw"), vocabulary, 64, batch * seq, 4)
    assert abs(measured - planned) <= 0.05 * planned, (measured, planned)
