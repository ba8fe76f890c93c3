"""Supervised fine-tuning with TRL's ``SFTTrainer`` and an OFT or POET adapter.

What it shows: ``SFTTrainer`` trains a PEFT model built from ``OftConfig`` / ``PoetConfig.for_finetuning()`` on a
chat-formatted dataset (a ``messages`` column, rendered by the tokenizer's chat template, the loss on the assistant
turns only), with the optimizer ``PoetTrainer`` would build (``create_poet_optimizer``: the rotations at their own
rate, a side of block size b at lr·32/b) and, for POET, ``MergeReinitCallback`` for the merge-then-reinitialize steps
and the optimizer-state resets; the saved adapter reloads with ``PeftModel.from_pretrained``. (``SFTTrainer(...,
peft_config=OftConfig(...))`` works too, as with PEFT's own configs, but trains every parameter at one rate.)

By default it runs on a CPU in under a minute: a small LLaMA built from a config (no download), fine-tuned on a chat
dataset made of the bundled plays' lines ("Continue this line: <line>" → the next line). On real checkpoints:

    python examples/sft_trl.py --model_name_or_path HuggingFaceTB/SmolLM2-135M-Instruct --dataset trl-lib/Capybara \\
        --method poet --max_steps 500 --output_dir runs/sft-poet

Needs the ``[examples]`` extra (``pip install -e ".[examples]"``).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import torch

# A minimal ChatML template with the generation markers TRL needs to train on the assistant turns only.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}<|im_start|>assistant\n{% generation %}{{ message['content'] }}"
    "<|im_end|>{% endgeneration %}\n"
    "{% else %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--model_name_or_path", default=None, help="a hub id or local folder; default: a small LLaMA from a config"
    )
    parser.add_argument(
        "--dataset",
        default=None,
        help="an HF chat dataset with a `messages` column; default: built from the bundled plays",
    )
    parser.add_argument("--method", choices=["oft", "poet"], default="oft")
    parser.add_argument("--max_steps", type=int, default=30)
    parser.add_argument(
        "--learning_rate",
        type=float,
        default=None,
        help="every rate; default: 3e-3 on the default (untrained) model, else scripts/finetune.py's: 1e-3 for OFT, "
        "and for POET's rotations the recipe's (POET_FINETUNE_RECIPES)",
    )
    parser.add_argument("--output_dir", default="outputs/sft-trl")
    return parser.parse_args(argv)


def chat_dataset(rows: int = 256):
    """``messages`` rows from consecutive lines of the bundled plays: the user gives a line, the assistant continues."""
    from datasets import Dataset

    from poet_hf.data import load_embedded_corpus

    text = load_embedded_corpus()["train"][0]["text"]
    lines = [line.strip() for line in text.splitlines() if len(line.strip()) > 20]
    pairs = list(zip(lines[:-1], lines[1:], strict=True))[:rows]
    return Dataset.from_dict(
        {
            "messages": [
                [{"role": "user", "content": f"Continue this line: {a}"}, {"role": "assistant", "content": b}]
                for a, b in pairs
            ]
        }
    )


def small_model_and_tokenizer():
    """A LLaMA built from a config, with the bundled tokenizer and ChatML special tokens."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from poet_hf.data import load_tokenizer

    tokenizer = load_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.pad_token = tokenizer.eos_token
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id,
    )
    return LlamaForCausalLM(config), tokenizer


def peft_config(method: str) -> Any:
    """OFT at its defaults, or POET's fine-tuning recipe (contiguous 32-blocks), merging every 10 steps to show it."""
    from poet_hf import OftConfig, PoetConfig

    if method == "oft":
        return OftConfig(task_type="CAUSAL_LM")
    return PoetConfig.for_finetuning(merge_every=10, task_type="CAUSAL_LM")


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Fine-tune, evaluate before and after, save the adapter and reload it; returns the figures."""
    from datasets import load_dataset
    from peft import PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    import poet_hf  # noqa: F401  (registers the tuners with PEFT)
    from poet_hf import MergeReinitCallback, create_poet_optimizer
    from poet_hf.tuners.poet import POET_FINETUNE_RECIPES

    if args.model_name_or_path is None:
        model, tokenizer = small_model_and_tokenizer()
    else:
        model, tokenizer = (
            AutoModelForCausalLM.from_pretrained(args.model_name_or_path),
            AutoTokenizer.from_pretrained(args.model_name_or_path),
        )
    if tokenizer.chat_template is None:
        tokenizer.chat_template = CHAT_TEMPLATE
    data = chat_dataset() if args.dataset is None else load_dataset(args.dataset, split="train")
    split = data.train_test_split(test_size=32, seed=0)
    recipe = POET_FINETUNE_RECIPES["default"]
    learning_rate = args.learning_rate or (3e-3 if args.model_name_or_path is None else 1e-3)
    rotation_rate = (
        None if args.learning_rate or args.model_name_or_path is None else recipe.learning_rate
    )  # None: learning_rate
    config = SFTConfig(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=8,
        learning_rate=learning_rate,
        lr_scheduler_type="constant",
        logging_steps=5,
        assistant_only_loss=True,
        max_length=128,
        report_to="none",
        save_strategy="no",
        seed=0,
        use_cpu=not torch.cuda.is_available(),
        bf16=torch.cuda.is_available(),
        eval_strategy="no",
        disable_tqdm=True,
    )
    model = get_peft_model(model, peft_config(args.method))
    # POET's rotations at their own rate, a side of block size b at rate·32/b (the recipe's); the scheduler comes
    # from `config`.
    optimizer = create_poet_optimizer(
        model,
        config,
        poet_learning_rate=rotation_rate if args.method == "poet" else None,
        poet_reference_block=recipe.reference_block,
    )
    callbacks = [MergeReinitCallback()] if args.method == "poet" else []
    trainer = SFTTrainer(
        model=model,
        args=config,
        train_dataset=split["train"],
        eval_dataset=split["test"],
        processing_class=tokenizer,
        optimizers=(optimizer, None),
        callbacks=callbacks,
    )
    before = trainer.evaluate()["eval_loss"]
    trainer.train()
    after = trainer.evaluate()["eval_loss"]
    adapter_dir = Path(args.output_dir) / "adapter"
    trainer.model.save_pretrained(adapter_dir)

    # The saved adapter reloads onto a fresh copy of the base model and computes the same logits.
    base = (
        small_model_and_tokenizer()[0]
        if args.model_name_or_path is None
        else AutoModelForCausalLM.from_pretrained(args.model_name_or_path)
    )
    reloaded = PeftModel.from_pretrained(base, adapter_dir).eval()
    ids = tokenizer.apply_chat_template(split["test"][0]["messages"], return_tensors="pt", return_dict=True)
    trainer.model.eval()
    with torch.no_grad():
        gap = (reloaded(**ids).logits - trainer.model(**ids).logits).abs().max().item()
    result = {
        "method": args.method,
        "eval_loss_before": before,
        "eval_loss_after": after,
        "perplexity_before": math.exp(before),
        "perplexity_after": math.exp(after),
        "reload_max_abs_gap": gap,
        "adapter_dir": str(adapter_dir),
    }
    (Path(args.output_dir) / "result.json").write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    print(json.dumps(run(parse_args()), indent=2))
