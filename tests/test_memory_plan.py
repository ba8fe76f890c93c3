"""The memory planner: its counts are the real model's, its formulas the paper's (POET Table 1)."""

from pathlib import Path

import pytest
import torch
from peft import get_peft_model
from script_modules import command_line_error, load_module

import poet_hf  # noqa: F401  (registers the tuners)
from poet_hf import PoetConfig
from poet_hf.recipes.memory_plan import plan_memory
from poet_hf.recipes.presets import PRESETS, build_llama
from poet_hf.training.optimizer import keep_32bit_states
from poet_hf.tuners.rotation.layer import rotation_layers

ROOT = Path(__file__).resolve().parent.parent
TINY = PRESETS["tiny"]  # hidden 128, FFN 256, 4 layers: every targeted weight is 128 × 128, 128 × 256 or 256 × 128


def _real_poet_model(block_size: int) -> torch.nn.Module:
    return get_peft_model(
        build_llama(TINY, "poet-bs", 32000, 64, seed=0), PoetConfig(block_size=block_size, train_other_params=True)
    )


def _one_optimizer_step(model: torch.nn.Module) -> torch.optim.AdamW:
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    ids = torch.randint(0, 32000, (2, 64), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    return optimizer


def test_parts_are_the_entries_and_bytes_a_trained_model_holds():
    plan = plan_memory("tiny", "poet-bs", block_size=32, batch_size=2, seq_len=64, accumulation=2)
    model = _real_poet_model(32)
    optimizer = _one_optimizer_step(model)
    frozen_w0 = sum(layer.get_base_layer().weight.numel() for _, layer in rotation_layers(model))
    trainable = [p for p in model.parameters() if p.requires_grad]
    states = [t for s in optimizer.state.values() for t in s.values() if t.dim() > 0]
    assert plan.counts["W0"] == frozen_w0
    assert plan.counts["trainable"] == sum(p.numel() for p in trainable)
    assert plan.counts["optimizer states"] == sum(t.numel() for t in states)
    assert plan.parts["W0"] == 4 * frozen_w0
    assert plan.parts["trainable parameters"] == sum(p.numel() * p.element_size() for p in trainable)
    assert plan.parts["gradients"] == sum(p.grad.numel() * p.grad.element_size() for p in trainable)
    assert plan.parts["optimizer states"] == sum(t.numel() * t.element_size() for t in states)
    caches = sum(
        2 * spec.num_blocks * spec.block**2 * 4
        for _, layer in rotation_layers(model)
        for spec in layer.rotation_specs["default"].values()
    )
    assert plan.parts["rotation caches"] == caches


def test_quantised_w0_8bit_states_and_fused_steps_are_the_bytes_a_real_model_holds():
    """Issue 42's terms against a real tiny POET model: nf4 W0 (codes, double-quantised scales; its error-feedback
    residual off the layer by default, or on it), bitsandbytes' 8-bit AdamW states after one step (the embeddings
    and the 128-wide head at 32 bits), and the gradients a fused step leaves alive at the backward's end (the largest
    one: the head's or the embedding's)."""
    import bitsandbytes as bnb

    plan = {"method": "poet-bs", "block_size": 32, "batch_size": 2, "seq_len": 64, "base_quantization": "nf4"}
    off, on = plan_memory("tiny", **plan), plan_memory("tiny", **plan, residual_storage="layer")
    model = get_peft_model(
        build_llama(TINY, "poet-bs", 32000, 64, seed=0),
        PoetConfig(block_size=32, train_other_params=True, base_quantization="nf4", residual_storage="layer"),
    )
    poet_hf.merge_and_reinit(model)  # the first fold creates the residual, on the layer here
    layers = [layer for _, layer in rotation_layers(model)]
    held = sum(layer.base_weight_bytes() for layer in layers)
    residual = sum(layer.get_base_layer().poet_residual_codes.numel() for layer in layers)
    scales = sum(layer.get_base_layer().poet_residual_scales.numel() * 4 for layer in layers)
    assert on.parts["W0"] == pytest.approx(held, abs=2 * len(layers))  # the quant-state header: 169-171 B
    assert off.parts["W0"] == pytest.approx(held - residual - scales, abs=2 * len(layers))

    trainable = [p for p in model.parameters() if p.requires_grad]
    assert keep_32bit_states(model, bnb.optim.AdamW8bit, {"optim_bits": 8}) == 2  # 128-wide rows
    optimizer = bnb.optim.AdamW8bit(trainable, lr=1e-3)
    ids = torch.randint(0, 32000, (2, 64), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    states = sum(
        t.numel() * t.element_size()
        for s in optimizer.state.values()
        for k, t in s.items()
        if k in ("state1", "state2", "absmax1", "absmax2")
    )
    eight_bit = plan_memory("tiny", **plan, optimizer_bits=8)
    assert eight_bit.parts["optimizer states"] == states

    fused = plan_memory("tiny", **plan, fused_step=True, checkpointing=True)
    if fused.settings["peak"] == "backward end":
        assert fused.parts["gradients"] == max(p.numel() * p.element_size() for p in trainable)
    unfused_end = plan_memory("tiny", **plan, checkpointing=True)
    assert fused.total_bytes <= unfused_end.total_bytes


@pytest.mark.parametrize("vocab_weights_dtype", ["float32", "bfloat16"])
def test_ddp_buckets_hold_the_gradients_ddp_reduces_with_fused_steps(vocab_weights_dtype):
    """DDP's buckets copy every gradient it reduces: with fused steps, those of the parameters that still require one
    once `FusedStepOptimizer` has chunked the head and embeddings by rows (DDP wraps the model after the optimizer
    is built), at their dtype. The tiny head (32000 × 128) is below a row chunk, so float32 keeps it whole; bfloat16
    chunks any size."""
    from poet_hf.training import FusedStepOptimizer

    model = _real_poet_model(32)
    every = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    dtype = None if vocab_weights_dtype == "float32" else torch.bfloat16
    groups = [{"params": [p for p in model.parameters() if p.requires_grad]}]
    FusedStepOptimizer(groups, torch.optim.AdamW, model=model, vocab_weights_dtype=dtype)
    reduced = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    plan = {"method": "poet-bs", "block_size": 32, "batch_size": 2, "seq_len": 64, "processes": 2}
    fused = plan_memory("tiny", **plan, fused_step=True, vocab_weights_dtype=vocab_weights_dtype)
    assert fused.parts["DDP gradient buckets"] == reduced
    assert plan_memory("tiny", **plan).parts["DDP gradient buckets"] == every
    assert (reduced < every) == (vocab_weights_dtype == "bfloat16")


def test_torchao_s_8bit_states_are_the_bytes_its_optimizer_allocates():
    """torchao's 8-bit AdamW quantizes the states of a tensor of 4096 entries or more that fills whole 256-entry
    blocks (the embeddings and the head among them: no 32-bit exception, unlike bitsandbytes') and keeps float32
    states for the rest (POET-BS 64's FFN skews: 4 × 2016 = 8064 entries, 31.5 blocks): the plan's states equal,
    byte for byte, what one step allocates (codes, a float32 scale per block, a 256-entry code table per state)."""
    from torchao.optim import AdamW8bit

    model = get_peft_model(
        build_llama(TINY, "poet-bs", 32000, 64, seed=0), PoetConfig(block_size=64, train_other_params=True)
    )
    optimizer = AdamW8bit([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    ids = torch.randint(0, 32000, (2, 64), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()

    def stored(tensor: torch.Tensor) -> int:
        if type(tensor) is torch.Tensor:
            return tensor.numel() * tensor.element_size()
        return sum(stored(getattr(tensor, name)) for name in tensor.__tensor_flatten__()[0])

    moments = [t for s in optimizer.state.values() for k, t in s.items() if k in ("exp_avg", "exp_avg_sq")]
    assert {type(t).__name__ for t in moments} == {"Tensor", "OptimState8bit"}  # both rules are exercised
    plan = plan_memory("tiny", "poet-bs", block_size=64, seq_len=64, optimizer_bits=8, eight_bit_library="torchao")
    assert plan.parts["optimizer states"] == sum(stored(t) for t in moments)


def test_targeted_layers_cost_what_table_1_of_the_poet_paper_says():
    b, r = 32, 16
    model = build_llama(TINY, "poet-bs", 32000, 64, seed=0)
    shapes = [
        module.weight.shape
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and "lm_head" not in name
    ]
    others = sum(p.numel() for n, p in model.named_parameters() if p.dim() != 2 or "proj" not in n)
    poet = plan_memory("tiny", "poet-bs", block_size=b, seq_len=64)
    # POET (BS): m·n + 3/2·(m+n)(b−1): the frozen weight, the skew parameters and their two Adam states.
    assert poet.counts["W0"] + 3 * poet.counts["adapter"] == sum(m * n + 3 * (m + n) * (b - 1) // 2 for m, n in shapes)
    adamw = plan_memory("tiny", "adamw", seq_len=64)  # AdamW: 3·m·n (weight and two states) for every matrix
    adamw_entries = adamw.counts["trainable"] + adamw.counts["optimizer states"]
    assert adamw_entries == 3 * sum(m * n for m, n in shapes) + 3 * others
    galore = plan_memory("tiny", "galore", rank=r, seq_len=64)  # GaLore: m·n + m·r + 2·n·r, with m ≤ n
    expected = sum(m * n + min(m, n) * r + 2 * max(m, n) * r for m, n in shapes) + 3 * others
    assert galore.counts["trainable"] + galore.counts["optimizer states"] == expected


def test_fully_stochastic_blocks_follow_table_1_per_side():
    plan = plan_memory("tiny", "poet-fs", budget=0.25, seq_len=64)
    model = build_llama(TINY, "poet-fs", 32000, 64, seed=0)
    shapes = [
        module.weight.shape
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and "lm_head" not in name
    ]
    # POET (FS) with one b × b block per side, b = budget · dimension: b(b−1)/2 skew entries per side.
    assert plan.counts["adapter"] == sum(d // 4 * (d // 4 - 1) // 2 for shape in shapes for d in shape)


def test_sharding_divides_model_state_and_adds_what_fsdp2_gathers():
    one = plan_memory("llama-60m", "poet-bs", processes=1)
    two = plan_memory("llama-60m", "poet-bs", processes=2, sharding="fsdp2")
    for part in ("W0", "trainable parameters", "optimizer states"):
        assert abs(two.parts[part] - one.parts[part] / 2) <= 0.01 * one.parts[part]
    assert two.parts["gathered layers"] > 0 and two.parts["activations"] == one.parts["activations"]
    ddp = plan_memory("llama-60m", "poet-bs", processes=2, sharding="ddp")
    assert ddp.parts["DDP gradient buckets"] == ddp.parts["trainable parameters"]


def test_checkpointing_keeps_one_input_per_block_instead_of_its_activations():
    full = plan_memory("llama-60m", "adamw")
    checkpointed = plan_memory("llama-60m", "adamw", checkpointing=True)
    assert checkpointed.parts["activations"] < full.parts["activations"] / 2


@pytest.mark.parametrize(
    "argument, value", [("method", "sgd"), ("sharding", "zero3"), ("dtype", "int8"), ("batch_size", 0), ("budget", 1.5)]
)
def test_bad_arguments_name_the_field(argument, value):
    with pytest.raises(ValueError, match=f"`{argument}`"):
        plan_memory("tiny", **{"method": "poet-bs", argument: value})


def test_command_line_prints_parts_and_ends_with_the_total(capsys):
    """scripts/plan_memory.py's main, in this process (a new interpreter would spend its time importing)."""
    script = load_module(ROOT / "scripts" / "plan_memory.py")
    flags = ["--preset", "llama-60m", "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "1"]
    assert script.main([*flags, "--compare", "adamw"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    from poet_hf.data import load_tokenizer
    from poet_hf.recipes.presets import PRESETS, preset_config

    run_model = preset_config(PRESETS["llama-60m"], "poet-bs", len(load_tokenizer()), 256)  # the embedded tokenizer's
    plan = plan_memory(run_model, "poet-bs", batch_size=4)
    assert lines[-1] == f"total: {plan.total_bytes / 2**20:.0f} MiB per process"
    assert lines[0].split()[-2:] == ["poet-bs", "adamw"]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--processes", "0"], "--processes must be an integer >= 1, got 0"),
        (["--method", "poet-xx"], "--method must be one of"),
        (["--block_size", "-5"], "--block_size must be an integer >= 2, got -5"),
        (["--sharding", "zero"], "argument --sharding: invalid choice: 'zero'"),
        (["--sharding", "fsdp2", "--processes", "2", "--optim", "adamw_bnb_8bit"], "with --optim adamw_torch_8bit"),
        (["--sharding", "fsdp2", "--processes", "2", "--base_quantization", "nf4"], "plan --base_quantization nf4-sh"),
        (
            ["--sharding", "fsdp2", "--processes", "2", "--fused_optimizer_step"],
            "`fused_optimizer_step` is not built for FSDP2 (world size 2)",
        ),
    ],
)
def test_an_argument_error_is_one_line_naming_the_flag_with_exit_status_2(capsys, flags, message):
    script = load_module(ROOT / "scripts" / "plan_memory.py")

    def plan() -> None:
        raise SystemExit(script.main(flags))

    assert message in command_line_error(capsys, plan)


def test_a_refused_run_prints_no_total_and_what_the_refused_saving_would_be_worth(capsys):
    """Fused steps on 2 FSDP2 processes are refused before a step; the planner says so on one line, prints no total,
    and gives the library's plans of the run as asked and without fused steps. At this shape both peak at the
    backward's start, where either holds only the head's gradient shard: the saving is nil."""
    import json

    script = load_module(ROOT / "scripts" / "plan_memory.py")
    flags = ["--preset", "llama-60m", "--sharding", "fsdp2", "--processes", "2", "--per_device_train_batch_size", "4"]
    flags += ["--gradient_accumulation_steps", "1", "--fused_optimizer_step"]
    assert script.main([*flags, "--json"]) == 2
    captured = capsys.readouterr()
    summary = json.loads(captured.out)
    assert captured.err.count("\n") == 1 and "world size 2" in captured.err and "total:" not in captured.out
    from poet_hf.data import load_tokenizer
    from poet_hf.recipes.presets import PRESETS, preset_config

    run_model = preset_config(PRESETS["llama-60m"], "poet-bs", len(load_tokenizer()), 256)
    common = {"batch_size": 4, "processes": 2, "sharding": "fsdp2", "block_size": PRESETS["llama-60m"].block_size}
    fused = plan_memory(run_model, "poet-bs", fused_step=True, **common).total_bytes / 2**20
    unfused = plan_memory(run_model, "poet-bs", **common).total_bytes / 2**20
    assert summary["asked_mb"] == pytest.approx(fused) and summary["runnable_mb"] == pytest.approx(unfused)
    assert summary["without"] == "--fused_optimizer_step" and unfused == pytest.approx(fused)
    assert script.main(flags) == 2
    assert "the refused saving is worth 0 MiB per process" in capsys.readouterr().out


def test_the_rotation_caches_are_planned_as_the_run_decides_them():
    """``cache_rotations``: ``True`` holds the blocks and their pending gradient, ``2·rows·b²`` float32 entries per side
    (counted off a real model); ``"auto"`` holds them at a few tokens per micro-batch and none under FSDP2 over 8
    processes, where each would be 8·b/(b−1) times the sharded rotations' state; without accumulation nothing."""
    model = _real_poet_model(32)
    caches = sum(
        2 * spec.num_blocks * spec.block**2 * 4
        for _, layer in rotation_layers(model)
        for spec in layer.rotation_specs["default"].values()
    )
    plan = {"method": "poet-bs", "block_size": 32, "batch_size": 2, "seq_len": 64}
    layers = len(rotation_layers(model))
    for cache, accumulation, sharding, expected in (
        (True, 2, {}, caches),
        ("auto", 2, {}, caches),
        ("auto", 2, {"sharding": "fsdp2", "processes": 8}, 0),
        (True, 2, {"sharding": "fsdp2", "processes": 8}, caches),
        ("auto", 1, {}, 0),
    ):
        planned = plan_memory("tiny", **plan, **sharding, accumulation=accumulation, cache_rotations=cache)
        assert planned.parts["rotation caches"] == expected, (cache, accumulation, sharding)
        cached = layers if expected else 0
        assert planned.settings["rotation caches"].startswith(
            f"rotation caches (cache_rotations={cache!r}): {cached} of {layers} layers cache"
        )


def test_the_plan_says_where_a_fully_stochastic_polynomial_outweighs_its_layer():
    """POET-FS at budget ½ of a 128-wide model and 128 tokens: one 64-block's polynomial, 11·64³ multiply-adds per
    side and micro-batch, against the layer's 3·128·128·d_out: the planner names the layers and what to use instead;
    POET-BS 32 at the same shape has no such layer."""
    fs = plan_memory("tiny", "poet-fs", budget=0.5, batch_size=2, seq_len=64, accumulation=2)
    assert any("POET-BS, or a smaller POET-FS budget" in note for note in fs.settings["notes"])
    bs = plan_memory("tiny", "poet-bs", block_size=32, batch_size=2, seq_len=64, accumulation=2)
    assert bs.settings["notes"] == []


LLAMA_2_70B = {  # the shape of meta-llama/Llama-2-70b-hf's config.json
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
}


def test_a_70b_poet_run_with_a_shardable_nf4_w0_plans_under_18_gib_on_eight_processes(tmp_path, capsys):
    """Llama-2-70B's shape, 8 FSDP2 processes, bfloat16, 1 × 4096 tokens, checkpointing, POET-BS with an
    ``nf4-shardable`` W0 and torchao's 8-bit states: under 18 GiB a process, where AdamW with the same flags needs
    over 48 GiB. Each
    cell is tested at small scale (tests/test_fsdp.py); its W0 is the kind's codes and scales, an eighth a process."""
    import json

    (tmp_path / "config.json").write_text(json.dumps(LLAMA_2_70B))
    script = load_module(ROOT / "scripts" / "plan_memory.py")
    flags = ["--config_name", str(tmp_path), "--processes", "8", "--sharding", "fsdp2", "--dtype", "bfloat16"]
    flags += ["--per_device_train_batch_size", "1", "--seq_len", "4096", "--activation_checkpointing"]
    flags += ["--method", "poet-bs", "--base_quantization", "nf4-shardable", "--optim", "adamw_torch_8bit"]
    assert script.main([*flags, "--compare", "adamw", "--json"]) == 0
    poet, adamw = json.loads(capsys.readouterr().out)
    assert poet["total_mb"] <= 18 * 1024 and adamw["total_mb"] > 48 * 1024  # AdamW: no 24 or 40 GB card
    linear_entries = 80 * (2 * 8192 * 8192 + 2 * 8192 * 1024 + 3 * 8192 * 28672)
    assert poet["counts"]["W0"] == linear_entries
    assert poet["parts_mb"]["W0"] == pytest.approx(linear_entries * (0.5 + 4 / 64) / 8 / 2**20, rel=1e-3)
    assert poet["residual_mb"] == 0  # a sharded W0 folds to nearest


@pytest.mark.parametrize("vocabulary, budget_gib", [(32000, 18), (128256, 20)])
def test_a_70b_run_with_the_chunked_loss_keeps_the_head_split_on_eight_processes(
    tmp_path, capsys, vocabulary, budget_gib
):
    """Llama-2-70B's and Llama-3-70B's shapes (a 128k vocabulary), the flags above and ``--loss_chunk_tokens 1024``:
    the head stays split by vocabulary rows (`poet_hf.training.sharded_head_loss`, tested in 2 processes in
    tests/test_fsdp.py), so what FSDP2 holds gathered at the peak is one block, not the head and its gradient twice;
    each fits its budget (18 and 20 GiB), with AdamW's plan of the same flags beside it."""
    import json

    (tmp_path / "config.json").write_text(json.dumps({**LLAMA_2_70B, "vocab_size": vocabulary}))
    script = load_module(ROOT / "scripts" / "plan_memory.py")
    flags = ["--config_name", str(tmp_path), "--processes", "8", "--sharding", "fsdp2", "--dtype", "bfloat16"]
    flags += ["--per_device_train_batch_size", "1", "--seq_len", "4096", "--activation_checkpointing"]
    flags += ["--method", "poet-bs", "--base_quantization", "nf4-shardable", "--optim", "adamw_torch_8bit"]
    assert script.main([*flags, "--compare", "adamw", "--json"]) == 0
    whole_loss = json.loads(capsys.readouterr().out)[0]
    assert script.main([*flags, "--loss_chunk_tokens", "1024", "--compare", "adamw", "--json"]) == 0
    poet, adamw = json.loads(capsys.readouterr().out)
    assert poet["total_mb"] <= budget_gib * 1024 < adamw["total_mb"]
    head_bytes = vocabulary * 8192 * 2  # bfloat16
    saved = whole_loss["parts_mb"]["gathered layers"] - poet["parts_mb"]["gathered layers"]
    assert saved == pytest.approx((head_bytes * 7 / 8 + 2 * head_bytes) / 2**20, rel=1e-6)
    assert poet["parts_mb"]["loss working set"] <= 600
