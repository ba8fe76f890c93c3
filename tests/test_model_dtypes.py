"""Models in the dtype their checkpoint's config declares (Llama-2's says float16): a bfloat16 model trains under each
saving of the 7B recipe with one compute dtype through its blocks; a float16 model trains its adapters, and is refused
before its build where weights would train in full in float16; the scripts build in float32 whatever a config says."""

from __future__ import annotations

import math

import pytest
import torch
from models import llama_config
from peft import get_peft_model
from training_utils import tiny_dataset
from transformers import AutoModelForCausalLM, default_data_collator

from poet_hf import PoetConfig, PoetTrainer, PoetTrainingArguments, create_poet_optimizer
from poet_hf.initialization import materialize_model

SAVINGS = {  # the 7B recipe's savings (docs/pretraining-7b.md), each alone and all together
    "nf4 W0": ({"base_quantization": "nf4"}, {}, False),
    "8-bit states": ({}, {"optim": "adamw_bnb_8bit"}, False),
    "fused steps": ({}, {"fused_optimizer_step": True}, False),
    "bf16 head and embeddings": ({}, {"fused_optimizer_step": True, "vocab_weights_dtype": "bfloat16"}, False),
    "checkpointing": ({}, {}, True),
}
SAVINGS["all of them"] = (
    {"base_quantization": "nf4"},
    {"optim": "adamw_bnb_8bit", "fused_optimizer_step": True, "vocab_weights_dtype": "bfloat16"},
    True,
)


@pytest.fixture(scope="module")
def data():
    return tiny_dataset()


def meta_model(dtype: str, vocab: int) -> torch.nn.Module:
    config = llama_config(vocab=vocab, max_position_embeddings=64, tie_word_embeddings=False, torch_dtype=dtype)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)  # as transformers builds it: in the config's dtype


def train_two_steps(tmp_path, data, model, training: dict, checkpointing: bool) -> tuple[float, set[torch.dtype]]:
    """Two steps of the recipe's public-API path; the loss and the dtypes that entered each decoder block and came
    out of each attention projection."""
    dataset, _ = data
    materialize_model(model, seed=0, device="cpu")
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    seen: set[torch.dtype] = set()
    inner = model.base_model.model.model
    for block in inner.layers:
        block.register_forward_pre_hook(lambda m, args, kwargs: seen.add(args[0].dtype), with_kwargs=True)
        for name in ("q_proj", "k_proj", "v_proj"):
            getattr(block.self_attn, name).register_forward_hook(lambda m, i, o: seen.add(o.dtype))
    args = PoetTrainingArguments(
        output_dir=str(tmp_path),
        max_steps=2,
        per_device_train_batch_size=2,
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        logging_steps=1,
        **training,
    )
    trainer = PoetTrainer(
        model=model,
        args=args,
        train_dataset=dataset,
        data_collator=default_data_collator,
        optimizers=(create_poet_optimizer(model, args), None),
    )
    return trainer.train().training_loss, seen


@pytest.mark.parametrize("saving", list(SAVINGS))
def test_a_bfloat16_model_trains_under_each_saving_with_one_compute_dtype(tmp_path, data, saving):
    config, training, checkpointing = SAVINGS[saving]
    vocab = len(data[1])
    model = get_peft_model(meta_model("bfloat16", vocab), PoetConfig(block_size=16, train_other_params=True, **config))
    loss, seen = train_two_steps(tmp_path, data, model, training, checkpointing)
    assert math.isfinite(loss) and loss < 1.5 * math.log(vocab)
    assert seen == {torch.bfloat16}  # the residual stream and every projection: one dtype


def test_a_float16_model_whose_weights_would_train_in_full_is_refused_before_its_build(data):
    model = meta_model("float16", len(data[1]))
    with pytest.raises(ValueError, match=r"would train 7 float16 weight\(s\) in full .*dtype=torch.float32"):
        get_peft_model(model, PoetConfig(block_size=16, base_quantization="nf4", train_other_params=True))
    assert all(p.is_meta for p in model.parameters())  # nothing was built


def test_a_float16_model_trains_its_rotations_with_every_saving_of_the_adapters(tmp_path, data):
    """A float16 model fine-tuned: only the float32 rotations train, beside its nf4 W0, in float16 compute."""
    model = get_peft_model(meta_model("float16", len(data[1])), PoetConfig(block_size=16, base_quantization="nf4"))
    loss, seen = train_two_steps(tmp_path, data, model, {"optim": "adamw_bnb_8bit", "fused_optimizer_step": True}, True)
    assert math.isfinite(loss) and seen == {torch.float16}
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.float32}
