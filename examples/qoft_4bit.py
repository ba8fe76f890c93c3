"""QOFT: orthogonal fine-tuning of a model loaded in 4-bit (``BitsAndBytesConfig(load_in_4bit=True)``).

What it shows: a causal LM loaded with ``BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
bnb_4bit_use_double_quant=True)`` (its Linear layers become bitsandbytes ``Linear4bit``), wrapped with ``OftConfig``
exactly as QLoRA wraps it with ``LoraConfig``, fine-tuned with ``PoetTrainer``; the adapter saved and reloaded onto a
freshly quantized base; and the result exported by ``export_merged`` as a plain float checkpoint that stock
``transformers`` loads without bitsandbytes. The frozen ``W0`` stays in 4 bits throughout: the fused layers
dequantize it once in the forward and once in the backward, never keeping the dense copy.

By default it runs on a CPU in under a minute: a small LLaMA built from a config, written to a temporary folder and
loaded back in 4-bit (no download), fine-tuned on the bundled Shakespeare. On a real checkpoint:

    python examples/qoft_4bit.py --model_name_or_path meta-llama/Llama-3.2-1B --max_steps 500 --output_dir runs/qoft

Needs the ``[quant]`` extra (bitsandbytes; part of ``[dev]``).
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
from pathlib import Path
from typing import Any

import torch


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--model_name_or_path", default=None, help="a hub id or local folder; default: a small LLaMA saved here"
    )
    parser.add_argument("--max_steps", type=int, default=40)
    parser.add_argument("--block_size", type=int, default=32)
    parser.add_argument("--learning_rate", type=float, default=5e-3)
    parser.add_argument("--output_dir", default="outputs/qoft")
    return parser.parse_args(argv)


def small_checkpoint(folder: str, vocab_size: int) -> str:
    """A small LLaMA written with ``save_pretrained``, to load back quantized as one would a real checkpoint."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(
        LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=128,
        )
    ).save_pretrained(folder)
    return folder


def load_4bit(path: str):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quantization = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.float32,
    )
    return AutoModelForCausalLM.from_pretrained(path, quantization_config=quantization, dtype=torch.float32)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Fine-tune in 4-bit, reload the adapter, export; returns the losses and the checks."""
    from peft import PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM, default_data_collator

    import poet_hf  # noqa: F401  (registers the tuners with PEFT)
    from poet_hf import OftConfig, PoetTrainer, PoetTrainingArguments, export_merged
    from poet_hf.data import load_corpus, load_tokenizer, pack_sequences

    tokenizer = load_tokenizer(None if args.model_name_or_path is None else args.model_name_or_path)
    with tempfile.TemporaryDirectory() as scratch:
        path = args.model_name_or_path or small_checkpoint(scratch, len(tokenizer))
        model = get_peft_model(load_4bit(path), OftConfig(block_size=args.block_size, task_type="CAUSAL_LM"))
        corpus = load_corpus("embedded")
        train = pack_sequences(corpus["train"], tokenizer, 64).select(range(256))
        evaluation = pack_sequences(corpus["validation"], tokenizer, 64).select(range(32))
        training = PoetTrainingArguments(
            output_dir=args.output_dir,
            max_steps=args.max_steps,
            per_device_train_batch_size=8,
            learning_rate=args.learning_rate,
            lr_scheduler_type="constant",
            logging_steps=10,
            save_strategy="no",
            report_to="none",
            seed=0,
            use_cpu=not torch.cuda.is_available(),
            disable_tqdm=True,
        )
        trainer = PoetTrainer(
            model=model,
            args=training,
            train_dataset=train,
            eval_dataset=evaluation,
            data_collator=default_data_collator,
        )
        before = trainer.evaluate()["eval_loss"]
        trainer.train()
        after = trainer.evaluate()["eval_loss"]

        adapter_dir = Path(args.output_dir) / "adapter"
        model.save_pretrained(adapter_dir)
        reloaded = PeftModel.from_pretrained(load_4bit(path), adapter_dir).eval()
        ids = torch.tensor(evaluation[:2]["input_ids"])
        model.eval()
        with torch.no_grad():
            adapter_logits = model(input_ids=ids).logits
            reload_gap = float((reloaded(input_ids=ids).logits - adapter_logits).abs().max())

        export_dir = Path(args.output_dir) / "export"  # dequantized, folded in float32: a plain checkpoint
        export_merged(model, export_dir, overwrite=True, spectrum=False)
        plain = AutoModelForCausalLM.from_pretrained(export_dir).eval()
        with torch.no_grad():
            export_gap = float((plain(input_ids=ids).logits - adapter_logits).abs().max())
    base_layer = type(reloaded.base_model.model.model.layers[0].self_attn.q_proj.get_base_layer()).__name__
    result = {
        "eval_loss_before": before,
        "eval_loss_after": after,
        "perplexity_before": math.exp(before),
        "perplexity_after": math.exp(after),
        "base_layer": base_layer,
        "reload_max_abs_gap": reload_gap,
        "export_max_abs_gap": export_gap,
        "logit_scale": float(adapter_logits.abs().max()),
        "export_has_quantization": (export_dir / "config.json").read_text().count('"quantization_config"') > 0,
    }
    (Path(args.output_dir) / "result.json").write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    print(json.dumps(run(parse_args()), indent=2))
