"""POET under FSDP2: two CPU processes (gloo) shard a small POET LLaMA with torch's ``fully_shard`` and train it with
poet_hf's merge, optimizer reset, checkpoint and export code (tests/workers/fsdp_worker.py); the Trainer/Accelerate path
needs an accelerator and runs where CUDA is available."""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import prewarmed
import pytest
import torch
from peft import PeftModel
from tolerances import tiny_model_tolerance
from training_utils import free_port
from transformers import AutoModelForCausalLM

import poet_hf  # noqa: F401

# One xdist worker runs every test here (pyproject: --dist loadgroup), so the module's 2-rank runs happen once.
pytestmark = pytest.mark.xdist_group("fsdp")

HERE = Path(__file__).resolve().parent
WORKER = str(HERE / "workers" / "fsdp_worker.py")


def torchrun(out: Path, *args: str, ranks: int = 2) -> list[dict]:
    """tests/workers/fsdp_worker.py in ``ranks`` processes, as ``torchrun --nproc_per_node`` starts them
    (tests/helpers/prewarmed.py)."""
    prewarmed.run(WORKER, [out, *args], out.parent / f"{out.name}.log", ranks=ranks, torchrun=True)
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(ranks)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp")
    results = {}
    for engine in ("ddp", "fsdp2"):
        for spo in ("block", "full"):
            extra = ["--save-at", "14"] if engine == "fsdp2" else []  # two steps after the first merge
            results[engine, spo] = (root / f"{engine}-{spo}", torchrun(root / f"{engine}-{spo}", engine, spo, *extra))
    return results


@pytest.mark.slow
@pytest.mark.parametrize("spo", ["block", "full"])
def test_fsdp2_trains_like_ddp_with_two_merges_and_identical_draws_on_every_rank(runs, spo):
    (_, ddp), (_, fsdp) = runs["ddp", spo], runs["fsdp2", spo]
    for ranks in (ddp, fsdp):
        assert ranks[0]["world"] == 2 and ranks[0]["merges"] == [1, 2]
        assert ranks[0]["buffers"] == ranks[1]["buffers"]  # the same permutations / index sets, drawn apart
    losses_ddp, losses_fsdp = ddp[0]["losses"], fsdp[0]["losses"]
    assert sorted(map(int, losses_fsdp)) == list(range(1, 31))
    assert max(abs(losses_ddp[k] - losses_fsdp[k]) for k in losses_ddp) <= 1e-5
    assert losses_fsdp["30"] < losses_fsdp["1"] - 0.01  # it trained
    # Each process holds half of every skew parameter, POET-FS's one-row vectors included (split along their long
    # dimension: fully_shard's dim-0 split would pad one row to every process, each holding it whole).
    assert ddp[0]["skew_local_share"] == 1.0
    assert all(rank["skew_local_share"] <= 0.5 + 1e-3 for rank in fsdp)


@pytest.mark.parametrize(
    "shape, processes, trainable, dim",
    [
        ((43, 32640), 2, True, 1),  # Llama-2-7B's FFN skew: 43 rows split 22 / 21, its vectors evenly
        ((43, 32640), 2, False, 0),  # frozen: no optimizer state, split by rows as fully_shard does
        ((16, 32640), 8, True, 0),  # rows that split evenly stay split by rows
        ((1, 32640), 2, False, 1),  # POET-FS's one-row vector: its long dimension
        ((5, 7), 2, True, 0),  # no dimension splits evenly: by rows
        ((11008, 2048), 8, False, 0),  # a shardable W0's codes: always by rows
    ],
)
def test_a_trainable_parameter_is_split_where_every_shard_has_one_shape(shape, processes, trainable, dim):
    from poet_hf.training.distributed import shard_dim

    assert shard_dim(torch.Size(shape), processes, trainable) == dim


@pytest.mark.slow
def test_a_merge_gathers_one_layer_at_a_time(runs):
    _, fsdp = runs["fsdp2", "block"]
    report = fsdp[0]
    # The most gathered bytes alive at once: one layer's W0, at most with one skew vector beside it.
    assert 0 < report["peak_gathered_bytes"] <= report["largest_weight_bytes"] + report["largest_skew_bytes"]
    _, ddp = runs["ddp", "block"]
    assert ddp[0]["peak_gathered_bytes"] == 0  # unsharded weights need no gather


@pytest.mark.slow
@pytest.mark.parametrize("spo", ["block", "full"])
def test_sharded_checkpoint_after_a_merge_resumes_with_identical_losses(runs, tmp_path, spo):
    directory, fsdp = runs["fsdp2", spo]
    resumed = torchrun(tmp_path / "resumed", "fsdp2", spo, "--resume-from", str(directory / "ckpt"))
    assert sorted(map(int, resumed[0]["losses"])) == list(range(15, 31))
    assert resumed[0]["merges"] == [2]  # the merge at 12 is in the checkpoint, the one at 24 happens again
    for step, loss in resumed[0]["losses"].items():
        assert abs(loss - fsdp[0]["losses"][step]) <= 1e-5, step
    assert resumed[0]["buffers"] == fsdp[0]["buffers"]


@pytest.mark.slow
def test_eight_bit_states_step_each_shard_and_bitsandbytes_is_refused(tmp_path):
    """torchao's AdamW8bit (``optim="adamw_torch_8bit"``) through `create_poet_optimizer` keeps 8-bit states per
    shard: 2 FSDP2 processes log the losses of 1 with the same global batch, through the merge at step 12 that zeroes
    the rotations' states (float32 sums in another order: a few 1e-7). bitsandbytes' kernels stop at a DTensor, so
    its optimizer is refused before a step, naming torchao's."""
    flags = ["fsdp2", "block", "--steps", "14", "--optim", "adamw_torch_8bit"]
    two, one = torchrun(tmp_path / "two", *flags), torchrun(tmp_path / "one", *flags, ranks=1)
    assert two[0]["merges"] == one[0]["merges"] == [1]
    assert min(two[0]["eight_bit_states"], one[0]["eight_bit_states"]) > 0  # the embeddings' and head's states
    assert sorted(one[0]["losses"]) == sorted(two[0]["losses"]) and len(one[0]["losses"]) == 14
    assert max(abs(loss - two[0]["losses"][step]) for step, loss in one[0]["losses"].items()) <= 1e-5
    refused = torchrun(tmp_path / "bnb", "fsdp2", "block", "--steps", "1", "--optim", "adamw_bnb_8bit", ranks=1)
    assert "AdamW8bit (bitsandbytes) cannot step the DTensor shards" in refused[0]["error"]
    assert "use optim='adamw_torch_8bit'" in refused[0]["error"]


@pytest.mark.slow
def test_a_sharded_checkpoint_resumes_on_another_process_count_through_a_merge(runs, tmp_path):
    """torch.distributed.checkpoint reshards on load: the 2-process checkpoint (step 14, after the merge at 12) resumes
    on 1 process, and a 1-process checkpoint on 2, each logging the 2-process run's losses through the merge at 24
    (the same global batch; the reduction order's rounding) with the same permutations drawn."""
    directory, fsdp = runs["fsdp2", "block"]
    fewer = torchrun(tmp_path / "fewer", "fsdp2", "block", "--resume-from", str(directory / "ckpt"), ranks=1)
    single = torchrun(tmp_path / "single", "fsdp2", "block", "--steps", "14", "--save-at", "14", ranks=1)
    more = torchrun(tmp_path / "more", "fsdp2", "block", "--resume-from", str(tmp_path / "single" / "ckpt"))
    for resumed in (fewer, more):
        assert sorted(map(int, resumed[0]["losses"])) == list(range(15, 31)) and resumed[0]["merges"] == [2]
        assert max(abs(loss - fsdp[0]["losses"][step]) for step, loss in resumed[0]["losses"].items()) <= 1e-5
        assert resumed[0]["buffers"] == fsdp[0]["buffers"]
    assert max(abs(loss - fsdp[0]["losses"][step]) for step, loss in single[0]["losses"].items()) <= 1e-5
    assert (fewer[0]["world"], single[0]["world"], more[0]["world"]) == (1, 1, 2)


@pytest.mark.slow
@pytest.mark.parametrize("spo", ["block", "full"])
def test_export_and_save_pretrained_from_fsdp2_are_plain_and_reproduce_the_logits(runs, spo):
    directory, _ = runs["fsdp2", spo]
    from training_utils import tiny_dataset, tiny_poet_model

    expected = torch.load(directory / "logits0.pt")
    dataset, tokenizer = tiny_dataset()
    ids = torch.tensor(dataset["input_ids"][:2])[:, :12]
    plain = AutoModelForCausalLM.from_pretrained(directory / "export").eval()
    assert not any("poet" in name or "base_layer" in name for name, _ in plain.named_parameters())
    base = tiny_poet_model(len(tokenizer), spo=spo, budget=0.5).get_base_model()  # any base: the adapter holds it all
    reloaded = PeftModel.from_pretrained(base, directory / "adapter").eval()
    with torch.no_grad():
        # The export's folded float32 weights and the live adapter associate the same products differently (the
        # folds add two ≤ 32-term sums per weight, inside the tiny model's count).
        tolerance = tiny_model_tolerance(torch.float32) * float(expected.abs().max())
        assert (plain(input_ids=ids).logits - expected).abs().max() <= tolerance
        assert (reloaded(input_ids=ids).logits - expected).abs().max() <= 1e-6
    assert sorted(p.name for p in (directory / "export").iterdir() if p.suffix == ".safetensors") == [
        "model.safetensors"
    ]  # written once, by rank 0


@pytest.mark.slow
def test_a_shardable_nf4_w0_trains_under_fsdp2_merges_as_one_process_and_resumes(runs, tmp_path):
    """nf4 codes held as plain tensors by row (``nf4-shardable``), 2 FSDP2 processes.

    - Every merge: the gathered codes and scales equal, bit for bit, those of rank 0's unsharded copy of the model
      from before the merge, merged by one process; every rank holds the same codes.
    - The losses of 1 process with the same global batch: until the first merge both use the same codes, so they
      agree as float32 runs do; after it, the folded weights of the two runs differ by their float sums, and a code
      flips where that difference straddles a rounding boundary. The quantization's own effect on the loss is the
      distance of the nf4 run from the float32 one (the module's 2-process run): at every step after the first
      merge the two process counts are closer than that.
    - Resumed from step 14 (after the first merge), through the second merge: identical losses and codes.
    - The export, read by stock transformers, gives the trained model's logits.
    - Built on ``meta``, sharded, then materialized shard by shard: the codes the model built whole holds.
    - With torchao's 8-bit states and activation checkpointing the merges are as exact (the states' blocks follow
      each shard, so the losses of two process counts part by the states' rounding, not by ``W0``'s).
    """
    nf4 = ["fsdp2", "block", "--base_quantization", "nf4-shardable"]
    two = torchrun(tmp_path / "two", *nf4, "--check_merges", "--save-at", "14")
    one = torchrun(tmp_path / "one", *nf4, ranks=1)
    resumed = torchrun(tmp_path / "resumed", *nf4, "--resume-from", str(tmp_path / "two" / "ckpt"))
    eight_bit = torchrun(
        tmp_path / "8bit", *nf4, "--check_merges", "--steps", "13", "--optim", "adamw_torch_8bit", "--checkpointing"
    )
    meta = torchrun(tmp_path / "meta", *nf4, "--meta", "--steps", "1")
    assert meta[0]["initial_codes"] == meta[1]["initial_codes"] == two[0]["initial_codes"]
    assert two[0]["merges"] == [1, 2] and two[0]["merges_equal"] == [True, True]
    assert eight_bit[0]["merges_equal"] == [True] and eight_bit[0]["eight_bit_states"] > 0
    assert eight_bit[0]["checkpointing"] and eight_bit[0]["losses"]["13"] < eight_bit[0]["losses"]["1"]
    assert two[0]["codes"] == two[1]["codes"]
    losses, single, plain = two[0]["losses"], one[0]["losses"], runs["fsdp2", "block"][1][0]["losses"]
    assert max(abs(losses[str(step)] - single[str(step)]) for step in range(1, 13)) <= 1e-5
    for step in range(13, 31):
        assert abs(losses[str(step)] - single[str(step)]) < abs(single[str(step)] - plain[str(step)]), step
    assert losses["30"] < losses["1"] - 0.5  # it trained
    assert resumed[0]["losses"] == {step: losses[step] for step in resumed[0]["losses"]}
    assert resumed[0]["codes"] == two[0]["codes"]
    from training_utils import tiny_dataset

    ids = torch.tensor(tiny_dataset()[0]["input_ids"][:2])[:, :12]
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "two" / "export").eval()
    expected = torch.load(tmp_path / "two" / "logits0.pt")
    with torch.no_grad():
        tolerance = tiny_model_tolerance(torch.float32) * float(expected.abs().max())
        assert (exported(input_ids=ids).logits - expected).abs().max() <= tolerance


def test_the_chunked_loss_keeps_the_head_split_and_trains_as_the_whole_logits_under_fsdp2(runs, tmp_path):
    """``--loss_chunk_tokens 24`` under FSDP2 (`poet_hf.training.sharded_head_loss`, `.sharded_embedding`): the head's
    and the input embeddings' units are never called, so never gathered, in 14 steps, and the losses through the
    first merge are the whole-logits run's to float32 rounding (as DDP's and FSDP2's, above: one float32 loss of a
    few thousand terms summed in another order, 1e-5 at a loss of 8). With every saving beside it (an nf4 ``W0``,
    torchao's 8-bit states, checkpointing), started by ``accelerate launch`` in 2 gloo processes, the merge is still
    the one-process merge, bit for bit, and it trains."""
    chunked = torchrun(tmp_path / "chunked", "fsdp2", "block", "--steps", "14", "--loss_chunk_tokens", "24")
    whole = runs["fsdp2", "block"][1][0]
    assert chunked[0]["head_calls"] == 0 and whole["head_calls"] == 30
    assert chunked[0]["embedding_calls"] == 0 and whole["embedding_calls"] == 30
    assert max(abs(chunked[0]["losses"][str(step)] - whole["losses"][str(step)]) for step in range(1, 15)) <= 1e-5
    savings = ["--base_quantization", "nf4-shardable", "--optim", "adamw_torch_8bit", "--checkpointing"]
    every = accelerate_launch(tmp_path / "every", "fsdp2", "block", "--steps", "13", "--check_merges", *savings,
                              "--loss_chunk_tokens", "24")  # fmt: skip
    assert every[0]["head_calls"] == every[0]["embedding_calls"] == 0
    assert every[0]["merges_equal"] == [True] and every[0]["eight_bit_states"] > 0
    assert every[0]["losses"]["13"] < every[0]["losses"]["1"] - 0.1


def accelerate_launch(out: Path, *args: str) -> list[dict]:
    """tests/workers/fsdp_worker.py under ``accelerate launch --multi_gpu --num_processes 2`` (gloo on a CPU), as a
    user launches a script of their own that shards with `shard_model` (Accelerate's FSDP plugin needs an
    accelerator): accelerate's launcher prepares the ranks, forked from the server of tests/helpers/prewarmed.py."""
    launch = ["--multi_gpu", "--num_processes", "2", "--main_process_port", str(free_port()), WORKER, out, *args]
    prewarmed.accelerate_launch(launch, out.parent / f"{out.name}.log", env={"OMP_NUM_THREADS": "1"})
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]


@pytest.mark.parametrize(
    "engine, refusal, settings",
    [
        ("fsdp1", "fsdp_version: 2", {}),
        ("fsdp2", None, {}),
        ("deepspeed", "`fused_optimizer_step` is not supported under DeepSpeed ZeRO", {"fused_optimizer_step": True}),
        (
            "deepspeed",
            r"optim='adamw_bnb_8bit' \(8-bit optimizer states\) .*universal checkpoint",
            {"optim": "adamw_bnb_8bit"},
        ),
        ("deepspeed", r"optim='adamw_torch_8bit' \(8-bit optimizer states\)", {"optim": "adamw_torch_8bit"}),
    ],
)
def test_poet_trainer_takes_fsdp2_and_refuses_fsdp1_and_what_zero_cannot_take(
    monkeypatch, tmp_path, engine, refusal, settings
):
    """PoetTrainer decides from what Accelerate reports about the engine it set up. FSDP cannot start on a CPU, so
    Trainer's own report (``is_deepspeed_enabled``, ``is_fsdp_enabled``, the FSDP plugin's version) is set as
    Accelerate sets it on an accelerator, and the real constructor runs on it. DeepSpeed with a supported run is
    trained for real in tests/test_deepspeed.py."""
    import transformers
    from training_utils import tiny_dataset, tiny_poet_model, tiny_trainer

    real = transformers.Trainer.create_accelerator_and_postprocess

    def report_engine(self):
        real(self)
        self.is_deepspeed_enabled = engine == "deepspeed"
        self.is_fsdp_enabled = engine.startswith("fsdp")
        if self.is_fsdp_enabled:
            monkeypatch.setattr(
                self.accelerator.state, "fsdp_plugin", SimpleNamespace(fsdp_version=int(engine[-1])), raising=False
            )

    monkeypatch.setattr(transformers.Trainer, "create_accelerator_and_postprocess", report_engine)
    dataset, tokenizer = tiny_dataset()
    if refusal is None:
        assert tiny_trainer(tmp_path, tiny_poet_model(len(tokenizer)), dataset).has_poet
        return
    with pytest.raises(ValueError, match=refusal):
        tiny_trainer(tmp_path, tiny_poet_model(len(tokenizer)), dataset, **settings)


def test_poet_trainer_refuses_an_fsdp_request_accelerate_cannot_honour_on_a_cpu(monkeypatch, tmp_path):
    from training_utils import tiny_dataset, tiny_poet_model, tiny_trainer

    dataset, tokenizer = tiny_dataset()
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")  # what `accelerate launch --use_fsdp` sets, CPU or not
    if torch.cuda.is_available():
        pytest.skip("on an accelerator Accelerate honours the request")
    with pytest.raises(ValueError, match="only enables FSDP on accelerators"):
        tiny_trainer(tmp_path, tiny_poet_model(len(tokenizer)), dataset)


@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="Accelerate enables FSDP only on accelerators; the CPU tests above drive fully_shard directly",
)
def test_accelerate_fsdp2_config_trains_pretrain_script_with_merges(tmp_path):
    env = {**os.environ}
    config = HERE.parent / "examples" / "cluster" / "fsdp2.yaml"
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(config),
        "--num_processes",
        str(min(2, torch.cuda.device_count())),
        str(HERE.parent / "scripts" / "pretrain.py"),
        "--max_steps",
        "8",
        "--merge_every",
        "4",
        "--per_device_train_batch_size",
        "2",
        "--seq_len",
        "64",
        "--output_dir",
        str(tmp_path),
        "--max_eval_samples",
        "8",
        "--export_dir",
        str(tmp_path / "export"),
    ]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["merges"] == 2 and results["val_loss"] < results["initial_val_loss"]
    assert (tmp_path / "export" / "model.safetensors").exists()
