"""Fine-tuning a small pretrained model with `scripts/finetune.py` (POET, OFT, LoRA) lowers
the evaluation loss, and the exported merged model reproduces the fine-tuned logits."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import poet_hf  # noqa: F401
from poet_hf.data import load_corpus, load_tokenizer, pack_sequences
from poet_hf.training.finetune import FinetuneArguments

ROOT = Path(__file__).resolve().parent.parent


def finetune_main(argv: list[str]) -> dict:
    spec = importlib.util.spec_from_file_location("finetune_script", ROOT / "scripts" / "finetune.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(argv)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A tiny LLaMA briefly pretrained on the embedded corpus's training plays, saved with its tokenizer, and a
    held-out play (the corpus's validation play) as a local .txt fine-tuning corpus."""
    root = tmp_path_factory.mktemp("finetune")
    tokenizer = load_tokenizer(None)
    corpus = load_corpus()
    train = pack_sequences(corpus["train"].select(range(3)), tokenizer, seq_len=64)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    ids = torch.tensor(train["input_ids"])
    losses = []
    for _ in range(40):
        batch = ids[torch.randint(0, len(ids), (8,), generator=generator)]
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
    assert losses[-1] < losses[0] - 1.0  # it really pretrained
    model.save_pretrained(root / "pretrained")
    tokenizer.save_pretrained(root / "pretrained")
    (root / "heldout.txt").write_text(corpus["validation"][0]["text"])
    return root


COMMON = ["--seq_len", "64", "--block_size", "16", "--max_steps", "20", "--batch_size", "8",
          "--max_eval_samples", "16", "--logging_steps", "1000", "--seed", "0", "--disable_tqdm", "true"]


@pytest.mark.parametrize("method,extra", [("oft", ["--learning_rate", "1e-2"]),
                                          ("poet", ["--learning_rate", "1e-2", "--merge_every", "7"]),
                                          ("lora", ["--learning_rate", "3e-3"])])
def test_finetune_lowers_eval_loss_and_export_reproduces_logits(workspace, method, extra):
    out = workspace / f"out_{method}"
    export = workspace / f"export_{method}"
    results = finetune_main(["--model", str(workspace / "pretrained"), "--method", method,
                             "--dataset", str(workspace / "heldout.txt"), "--output_dir", str(out),
                             "--export_dir", str(export), *COMMON, *extra])
    before, after = results["before"]["loss"], results["after"]["loss"]
    assert after < before - 0.05, (before, after)
    assert results["steps"] == 20
    written = json.loads((out / "results.json").read_text())
    assert written["after"]["loss"] == after and written["before"]["loss"] == before
    if method == "poet":  # merge-then-reinitialize ran during fine-tuning (20 steps, every 7)
        callback = next(cb for cb in results["trainer"].callback_handler.callbacks if hasattr(cb, "history"))
        assert [h["step"] for h in callback.history] == [7, 14]

    finetuned = results["trainer"].model.eval()
    ids = torch.randint(0, 4096, (2, 32), generator=torch.Generator().manual_seed(3))
    exported = AutoModelForCausalLM.from_pretrained(export).eval()
    assert not any("poet" in n or "lora" in n for n, _ in exported.named_parameters())
    with torch.no_grad():
        expected = finetuned(input_ids=ids).logits
        got = exported(input_ids=ids).logits
    assert (got - expected).abs().max() <= 1e-4 * expected.abs().max()


def test_classification_reports_accuracy_before_and_after(workspace, tmp_path):
    # Label: is the line a question? A decoder classifier reads the last token, so this is learnable quickly.
    lines = [line.strip() for line in (workspace / "heldout.txt").read_text().splitlines() if len(line.split()) >= 3]
    questions = [line for line in lines if line.endswith("?")][:150]
    others = [line for line in lines if not line.endswith("?")][:len(questions)]
    rows = [{"text": line, "label": int(line.endswith("?"))} for pair in zip(questions, others) for line in pair]
    assert len(rows) >= 200
    data = tmp_path / "lines.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows))
    results = finetune_main(["--model", str(workspace / "pretrained"), "--method", "oft", "--task",
                             "sequence-classification", "--dataset", str(data), "--output_dir", str(tmp_path / "o"),
                             "--seq_len", "32", "--block_size", "16", "--max_steps", "30", "--batch_size", "16",
                             "--learning_rate", "3e-3", "--logging_steps", "1000", "--disable_tqdm", "true"])
    assert set(results["before"]) == {"loss", "accuracy"}
    assert results["after"]["loss"] < results["before"]["loss"]
    assert results["after"]["accuracy"] >= 0.8 > results["before"]["accuracy"]


@pytest.mark.parametrize("fields,named", [({"method": "adapter"}, "`method`"), ({"task": "ner"}, "`task`"),
                                          ({"method": "oft", "spo": "full"}, "`spo`"),
                                          ({"task": "sequence-classification"}, "`dataset`")])
def test_bad_arguments_are_named(fields, named):
    with pytest.raises(ValueError, match=named):
        FinetuneArguments(model="x", **fields)


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """The tiny preset pretrained with AdamW on five of the bundled plays (400 steps of 8 × 128 tokens): a small
    model that has learned something, for the fine-tuning defaults to improve on without destroying it."""
    from poet_hf.data import load_embedded_corpus
    from poet_hf.training.pretrain import PretrainArguments, run_pretraining

    root = tmp_path_factory.mktemp("pretrained")
    plays = root / "plays"
    plays.mkdir()
    for row in load_embedded_corpus()["train"].select(range(5)):
        (plays / f"{row['title']}.txt").write_text(row["text"])
    results = run_pretraining(PretrainArguments(method="adamw", dataset=str(plays), steps=400, batch_size=8,
                                                seq_len=128, output_dir=str(root / "model"), logging_steps=1000))
    assert results["val_perplexity"] < results["initial_val_perplexity"] / 10
    return root / "model"


@pytest.mark.slow
@pytest.mark.parametrize("method", ["poet", "oft", "lora"])
def test_default_learning_rates_improve_a_pretrained_model_without_an_angle_warning(pretrained, tmp_path, caplog,
                                                                                     method):
    with caplog.at_level("WARNING", logger="poet_hf.training.callback"):
        results = finetune_main(["--model", str(pretrained), "--method", method, "--max_steps", "60",
                                 "--output_dir", str(tmp_path), "--logging_steps", "1000", "--disable_tqdm", "true"])
    assert results["trainer"].args.learning_rate == {"poet": 2e-4, "oft": 1e-3, "lora": 1e-3}[method]
    assert results["after"]["perplexity"] < 0.9 * results["before"]["perplexity"]
    assert not [r for r in caplog.records if "FINETUNE_WARN_ANGLE" in r.getMessage()]


@pytest.mark.slow
def test_a_rotation_rate_far_too_large_for_fine_tuning_is_warned_about_early(pretrained, tmp_path, caplog):
    with caplog.at_level("WARNING", logger="poet_hf.training.callback"):
        results = finetune_main(["--model", str(pretrained), "--method", "poet", "--learning_rate", "1e-2",
                                 "--max_steps", "20", "--output_dir", str(tmp_path), "--logging_steps", "1000",
                                 "--disable_tqdm", "true"])
    warnings = [r.getMessage() for r in caplog.records if "FINETUNE_WARN_ANGLE" in r.getMessage()]
    assert len(warnings) == 1 and "0.01" in warnings[0]
    layers = [layer for _, layer in __import__("poet_hf").tuners.poet.poet_layers(results["trainer"].model)]
    assert max(layer.rotation_angle("default") for layer in layers) > 45
