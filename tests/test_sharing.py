"""Sharing and serving. `export_peft_adapter`: an OFT adapter written in PEFT's own OFTConfig format loads, in a
process that imports only transformers and PEFT, and computes what the poet_hf model computes; what PEFT's format
cannot hold is refused with the reason. The card of an adapter PoetTrainer saves says how to load it, and its snippet
does. Serving: greedy generation from the merged export through a stock `transformers` pipeline equals the adapter
model's."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch
from models import llama_config
from peft import get_peft_model
from tolerances import tiny_model_tolerance
from transformers import LlamaForCausalLM

from poet_hf import OftConfig, PoetConfig, PoetTrainer, PoetTrainingArguments, export_peft_adapter, merge_and_reinit
from poet_hf.data import load_tokenizer
from poet_hf.export import ExportError, export_merged

IDS = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(0))

# The child loads the base and the adapter with stock PEFT, checks that poet_hf never came in, and writes its logits.
LOAD = r"""
import sys, torch
from peft import PeftModel
from transformers import LlamaForCausalLM
base = LlamaForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float64)
model = PeftModel.from_pretrained(base, sys.argv[2]).eval()
assert "poet_hf" not in sys.modules, "poet_hf was imported"
ids = torch.load(sys.argv[3])
with torch.no_grad():
    torch.save(model(input_ids=ids).logits, sys.argv[4])
"""


def train(model, steps: int = 3):
    """A few AdamW steps, so that the rotations are far from the identity."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-2)
    model.train()
    for _ in range(steps):
        model(input_ids=IDS, labels=IDS).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.eval()


def wrapped_checkpoint(base_dir, config):
    """A float64 tiny LLaMA saved to ``base_dir`` as a user's checkpoint, then wrapped with ``config``."""
    torch.manual_seed(0)
    base = LlamaForCausalLM(llama_config()).double()
    base.save_pretrained(base_dir)
    return get_peft_model(base, config)


def stock_logits(stock_python, tmp_path, base_dir, adapter_dir) -> torch.Tensor:
    torch.save(IDS, tmp_path / "ids.pt")
    result = stock_python.run(LOAD, str(base_dir), str(adapter_dir), "ids.pt", "logits.pt", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    return torch.load(tmp_path / "logits.pt")


def forward_tolerance(logits: torch.Tensor) -> float:
    # The same products in another order (PEFT rotates the activations; a weight forward rotates W0), in float64.
    return tiny_model_tolerance(torch.float64) * float(logits.abs().max())


@pytest.mark.parametrize("neumann_terms", [5, 0], ids=["neumann", "exact-cayley"])
def test_an_oft_adapter_in_peft_format_loads_in_stock_peft_with_the_same_logits(tmp_path, stock_python, neumann_terms):
    base_dir = tmp_path / "base"
    model = train(wrapped_checkpoint(base_dir, OftConfig(block_size=16, neumann_terms=neumann_terms, forward="weight")))
    with torch.no_grad():
        expected = model(input_ids=IDS).logits
        with model.disable_adapter():
            identity = model(input_ids=IDS).logits
    folder = export_peft_adapter(model, tmp_path / "adapter")
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["peft_type"] == "OFT" and config["oft_block_size"] == 16
    assert config["use_cayley_neumann"] is (neumann_terms != 0)
    card = (folder / "README.md").read_text()
    assert "poet_hf` is not needed" in card and "library_name: peft" in card
    got = stock_logits(stock_python, tmp_path, base_dir, folder)
    assert float((expected - identity).abs().max()) > 1e-2  # the adapter really rotates
    torch.testing.assert_close(got, expected, rtol=0, atol=forward_tolerance(expected))


def test_merges_are_written_into_a_base_beside_the_adapter(tmp_path, stock_python):
    model = train(wrapped_checkpoint(tmp_path / "base", OftConfig(block_size=16, merge_every=1, forward="weight")))
    merge_and_reinit(model)
    train(model, steps=1)
    with torch.no_grad():
        expected = model(input_ids=IDS).logits
    with pytest.raises(ExportError, match="base_output_dir="):
        export_peft_adapter(model, tmp_path / "refused")
    assert not (tmp_path / "refused").exists()
    folder = export_peft_adapter(model, tmp_path / "adapter", base_output_dir=tmp_path / "merged-base")
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(tmp_path / "merged-base")
    got = stock_logits(stock_python, tmp_path, tmp_path / "merged-base", folder)
    torch.testing.assert_close(got, expected, rtol=0, atol=forward_tolerance(expected))


@pytest.mark.parametrize(
    "config,reason",
    [
        (OftConfig(block_size=16, spo="block"), "contiguous blocks only"),
        (OftConfig(block_size=16, neumann_terms=3), "its 3 terms are our 4"),
        (PoetConfig(block_size=16), "a POET adapter"),
    ],
    ids=["permuted-blocks", "three-terms", "poet"],
)
def test_what_peft_cannot_hold_is_refused_with_the_reason(tmp_path, config, reason):
    model = get_peft_model(LlamaForCausalLM(llama_config()), config)
    with pytest.raises(ExportError, match=reason):
        export_peft_adapter(model, tmp_path / "adapter")
    assert not (tmp_path / "adapter").exists()


def test_the_card_of_an_adapter_poet_trainer_saves_says_how_to_load_it(tmp_path, stock_python):
    LlamaForCausalLM(llama_config()).save_pretrained(tmp_path / "base")
    model = get_peft_model(LlamaForCausalLM.from_pretrained(tmp_path / "base"), PoetConfig(block_size=16))
    args = PoetTrainingArguments(output_dir=str(tmp_path / "run"), report_to="none", use_cpu=True)
    PoetTrainer(model=model, args=args).save_model()
    card = (tmp_path / "run" / "README.md").read_text()
    assert "pip install dist/poet_hf-*.whl" in card and "library_name: peft" in card
    snippet = re.search(r"```python\n(.*?)```", card, re.S).group(1)
    assert "import poet_hf" in snippet and str(tmp_path / "base") in snippet
    loaded = subprocess.run([sys.executable, "-c", snippet], cwd=tmp_path, capture_output=True, text=True)
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    # Without the import, stock PEFT stops where the card and docs/troubleshooting.md say it does.
    stock = stock_python.run(snippet.replace("import poet_hf", "pass"), cwd=tmp_path)
    assert stock.returncode != 0 and "KeyError: 'POET'" in stock.stderr


# The child serves the merged export as a user would, with a pipeline, and writes the greedy continuation's ids.
GENERATE = r"""
import json, sys
from transformers import pipeline
generator = pipeline("text-generation", model=sys.argv[1], device="cpu")
out = generator(sys.argv[2], max_new_tokens=16, do_sample=False, return_tensors=True)
assert "poet_hf" not in sys.modules and "peft" not in sys.modules
json.dump(out[0]["generated_token_ids"], open(sys.argv[3], "w"))
"""


def test_greedy_generation_from_the_merged_export_through_a_pipeline_equals_the_adapters(tmp_path, stock_python):
    tokenizer = load_tokenizer()
    torch.manual_seed(0)
    base = LlamaForCausalLM(llama_config(vocab=len(tokenizer), bos_token_id=None, eos_token_id=None))
    model = train(get_peft_model(base, PoetConfig(block_size=16, merge_every=1)))
    merge_and_reinit(model)
    train(model, steps=1)
    prompt = "The orthogonal"
    inputs = tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(
            **inputs, max_new_tokens=16, do_sample=False, output_scores=True, return_dict_in_generate=True
        )
    expected = out.sequences[0].tolist()  # the prompt and its greedy continuation
    assert len(expected) == inputs["input_ids"].shape[1] + 16
    top_two = torch.stack([scores[0].topk(2).values for scores in out.scores])
    # Greedy decoding is unambiguous here: every step's best token leads by far more than the fold's rounding.
    assert float((top_two[:, 0] - top_two[:, 1]).min()) > 1e-4
    export_merged(model, tmp_path / "merged", tokenizer=tokenizer, dtype="fp32", spectrum=False)
    result = stock_python.run(GENERATE, str(tmp_path / "merged"), prompt, "generated.json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((tmp_path / "generated.json").read_text()) == expected
