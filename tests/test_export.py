"""Exporting POET / OFT / orthogonal models as plain checkpoints: logits, model cards, Hub push, atomic writes.

Every exported model is checked in a fresh Python process that never imports poet_hf, with stock
``transformers`` Auto classes, against the logits of the POET model it came from (the reference).
The Hub is replaced by ``StandInHub`` (tests/helpers/hub_stand_in.py), a small HTTP server on 127.0.0.1: a stand-in, not
the Hub.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from hub_stand_in import StandInHub, reach_stand_in
from models import tiny_gpt2, tiny_llama
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, ViTConfig, ViTForImageClassification

from poet_hf import PoetConfig, merge_and_reinit
from poet_hf.export import ExportError, HubPushError, export_merged, push_merged_to_hub
from poet_hf.model_cards import template_path
from poet_hf.tuners.rotation.layer import rotation_layers

REPO = Path(__file__).resolve().parents[1]
IDS = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
PIXELS = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(2))
LABELS = torch.tensor([1, 3])
SUBPROCESS_TIMEOUT = 180


# --- building and training tiny POET models ------------------------------------------------------------------------
def tiny_vit() -> ViTForImageClassification:
    """A ViT whose conv patch embedding (an nn.Conv2d) is a POET target, beside its Linear layers."""
    torch.manual_seed(0)
    config = ViTConfig(
        image_size=16,
        patch_size=4,
        num_channels=3,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        num_labels=5,
    )
    return ViTForImageClassification(config).eval()


VIT_TARGETS = ["projection", "q_proj", "k_proj", "v_proj", "o_proj", "fc1", "fc2"]


def inputs_for(kind: str) -> dict:
    return {"pixel_values": PIXELS} if kind == "vit" else {"input_ids": IDS}


def train(model, kind: str, steps: int = 4, merge_at: tuple[int, ...] = (2,)):
    """A few AdamW steps on a fixed batch, with merge-then-reinitialize after the steps in ``merge_at``."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    labels = {"labels": LABELS} if kind == "vit" else {"labels": IDS}
    model.train()
    for step in range(1, steps + 1):
        model(**inputs_for(kind), **labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step in merge_at:
            merge_and_reinit(model)
            optimizer.state.clear()
    model.eval()
    layers = rotation_layers(model)
    assert layers and all(int(layer.poet_merge_count["default"]) == len(merge_at) for _, layer in layers)
    assert max(float(layer.poet_R["default"].abs().max()) for _, layer in layers) > 1e-3  # live, non-identity factors
    return model


def trained(kind: str, **config):
    if kind == "vit":
        base, fields = tiny_vit(), {"block_size": 16, "target_modules": VIT_TARGETS}
    else:
        base, fields = {"llama": tiny_llama, "gpt2": tiny_gpt2}[kind](), {"block_size": 16}
    return train(get_peft_model(base, PoetConfig(**{**fields, **config})), kind)


@torch.no_grad()
def logits(model, kind: str) -> torch.Tensor:
    return model(**inputs_for(kind)).logits


# --- the independent check: stock transformers in a fresh process --------------------------------------------------
FRESH_PROCESS = textwrap.dedent("""
    import json, sys, torch
    import transformers
    from transformers import AutoConfig
    spec = json.loads(sys.argv[1])
    auto = getattr(transformers, spec["auto"])
    model, info = auto.from_pretrained(spec["dir"], output_loading_info=True, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        out = model(**torch.load(spec["inputs"])).logits
    fresh = auto.from_config(AutoConfig.from_pretrained(spec["dir"]))
    shapes = lambda m: {n: list(p.shape) for n, p in m.named_parameters()}
    print(json.dumps({
        "diff": float((out - torch.load(spec["expected"])).abs().max()),
        "class": type(model).__name__,
        "same_names_and_shapes": shapes(model) == shapes(fresh),
        "num_params": len(shapes(model)),
        "bad_keys": [str(k) for name in ("missing_keys", "unexpected_keys", "mismatched_keys") for k in info[name]],
        "poet_hf_imported": "poet_hf" in sys.modules,
    }))
""")


def check_in_fresh_process(stock_python, export_dir: Path, kind: str, expected: torch.Tensor, tmp_path: Path) -> dict:
    """Load ``export_dir`` with a stock Auto class in a new process that never imports poet_hf (the
    ``stock_python`` fixture)."""
    side = tmp_path / f"reference-{kind}"
    side.mkdir(exist_ok=True)
    torch.save(inputs_for(kind), side / "inputs.pt")
    torch.save(expected, side / "expected.pt")
    spec = {
        "dir": str(export_dir),
        "inputs": str(side / "inputs.pt"),
        "expected": str(side / "expected.pt"),
        "auto": "AutoModelForImageClassification" if kind == "vit" else "AutoModelForCausalLM",
    }
    done = stock_python.run(FRESH_PROCESS, json.dumps(spec), cwd=tmp_path, timeout=SUBPROCESS_TIMEOUT)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["poet_hf_imported"] is False
    assert result["same_names_and_shapes"] and result["num_params"] > 0 and result["bad_keys"] == []
    assert result["diff"] <= 1e-5, result
    return result


def assert_plain_export(path: Path) -> None:
    names = {p.name for p in path.iterdir()}
    assert {"config.json", "README.md"} <= names and any(n.endswith(".safetensors") for n in names), names
    assert "adapter_config.json" not in names
    keys = set()
    for shard in path.glob("*.safetensors"):
        keys |= set(load_file(shard))
    assert keys and not any("poet_" in k or "base_layer" in k or "lora" in k for k in keys)


@pytest.mark.numerics
# --- in-memory LLaMA, GPT-2 (Conv1D), ViT (Conv2d patch embedding) ----------------------------
@pytest.mark.parametrize("kind,spo", [("llama", "block"), ("gpt2", "full"), ("vit", "block")])
def test_export_in_memory_model_loads_in_stock_transformers(tmp_path, kind, spo, stock_python):
    model = trained(kind, spo=spo)
    expected = logits(model, kind)
    path = export_merged(model, tmp_path / "export")
    assert_plain_export(path)
    result = check_in_fresh_process(stock_python, path, kind, expected, tmp_path)
    assert result["class"] == type(model.get_base_model()).__name__
    # the export did not touch the POET model it came from
    assert rotation_layers(model) and torch.equal(logits(model, kind), expected)


# --- OFT and orthogonal-layer adapters fold through the same path -------------------------------------------------
def test_export_oft_and_orthogonal_models(tmp_path, stock_python):
    from transformers import AutoModelForCausalLM as StockAuto

    from poet_hf.tuners.oft import OftConfig
    from poet_hf.tuners.orthogonal_layers import OrthogonalConfig

    oft = get_peft_model(tiny_llama(), OftConfig(block_size=16, init_weights=False))  # random, non-identity
    expected = logits(oft, "llama")
    assert (expected - logits(tiny_llama(), "llama")).abs().max() > 1e-3
    path = export_merged(oft, tmp_path / "oft")
    assert "**OFT**" in (path / "README.md").read_text()
    check_in_fresh_process(stock_python, path, "llama", expected, tmp_path)
    orth = get_peft_model(tiny_llama(), OrthogonalConfig(target_modules=["q_proj", "v_proj"], init_weights=False))
    expected = logits(orth, "llama")
    plain = StockAuto.from_pretrained(export_merged(orth, tmp_path / "orth", spectrum=False), dtype=torch.float32)
    assert (logits(plain, "llama") - expected).abs().max() <= 1e-5
    reflection = get_peft_model(
        tiny_llama(), OrthogonalConfig(target_modules=["q_proj"], parameterization="reflection")
    )
    with pytest.raises(ExportError, match="cannot be folded into plain weights.*reflection"):
        export_merged(reflection, tmp_path / "reflection")
    assert not (tmp_path / "reflection").exists()


# --- a save_pretrained adapter directory (sharded, with tokenizer) -----------------------------------
def word_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(126)} | {"[UNK]": 126, "[PAD]": 127}
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]", pad_token="[PAD]")


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory) -> tuple[Path, torch.Tensor]:
    """A save_pretrained POET directory (with a tokenizer) and its model's logits, shared by the tests below."""
    return saved_adapter_dir(tmp_path_factory.mktemp("saved"))


def saved_adapter_dir(tmp_path: Path, **config) -> tuple[Path, torch.Tensor]:
    """Base saved locally (so base_model_name_or_path is a local path), POET trained, adapter saved."""
    base_dir = tmp_path / "base"
    tiny_llama().save_pretrained(base_dir)
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32), PoetConfig(block_size=16, **config)
    )
    train(model, "llama")
    adapter_dir = tmp_path / "adapter"
    model.save_pretrained(adapter_dir)
    word_tokenizer().save_pretrained(adapter_dir)
    return adapter_dir, logits(model, "llama")


def test_export_from_save_pretrained_directory_sharded_with_tokenizer(tmp_path, adapter_dir, stock_python):
    from transformers import AutoTokenizer

    adapter_dir, expected = adapter_dir
    assert json.loads((adapter_dir / "adapter_config.json").read_text())["base_model_name_or_path"]
    path = export_merged(adapter_dir, tmp_path / "export", max_shard_size="150KB")
    assert_plain_export(path)
    shards = sorted(p.name for p in path.glob("model-*.safetensors"))
    assert len(shards) >= 2 and (path / "model.safetensors.index.json").is_file()
    assert AutoTokenizer.from_pretrained(path)("w3 w7 w125")["input_ids"] == [3, 7, 125]
    check_in_fresh_process(stock_python, path, "llama", expected, tmp_path)


# --- a PoetTrainer checkpoint, pretrained from scratch (rebuilt from its config.json) ----------------
def test_export_from_poet_trainer_checkpoint(tmp_path, stock_python):
    from poet_hf.training import PoetTrainer, PoetTrainingArguments

    model = get_peft_model(tiny_llama(), PoetConfig(block_size=16, base_init="normalized", merge_every=2))
    rows = [{"input_ids": IDS[i % 2], "labels": IDS[i % 2]} for i in range(8)]
    args = PoetTrainingArguments(
        output_dir=str(tmp_path / "run"),
        max_steps=5,
        save_steps=5,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        poet_learning_rate=5e-3,
        logging_steps=2,
        report_to=[],
        use_cpu=True,
        save_strategy="steps",
        eval_strategy="steps",
        eval_steps=5,
        dataloader_num_workers=0,
        seed=0,
    )
    trainer = PoetTrainer(
        model=model, args=args, train_dataset=rows, eval_dataset=rows[:2], processing_class=word_tokenizer()
    )
    trainer.train()
    model.eval()
    expected = logits(model, "llama")
    checkpoint = tmp_path / "run" / "checkpoint-5"
    assert {"adapter_config.json", "config.json", "trainer_state.json"} <= {p.name for p in checkpoint.iterdir()}
    layer = rotation_layers(model)[0][1]
    assert int(layer.poet_merge_count["default"]) == 2 and layer.poet_R["default"].abs().max() > 0  # live factors
    path = export_merged(checkpoint, tmp_path / "export")
    assert_plain_export(path)
    assert (path / "tokenizer.json").is_file()
    check_in_fresh_process(stock_python, path, "llama", expected, tmp_path)
    card = (path / "README.md").read_text()
    assert "| learning rate | 0.01 |" in card and "| POET learning rate | 0.005 |" in card
    assert "| merge_every | 2 |" in card and "| base_init | normalized |" in card
    eval_loss = next(e["eval_loss"] for e in trainer.state.log_history if "eval_loss" in e)
    assert f"| eval_loss | {eval_loss:.4g} |" in card and "| step | 5 |" in card
    # the trainer itself is a source too (what scripts/pretrain.py --export-dir uses): same weights, same card facts
    direct = export_merged(trainer, tmp_path / "from-trainer", spectrum=False)
    ours, theirs = load_file(direct / "model.safetensors"), load_file(path / "model.safetensors")
    assert ours.keys() == theirs.keys() and all(torch.allclose(ours[k], theirs[k], atol=1e-6) for k in ours)
    assert "| POET learning rate | 0.005 |" in (direct / "README.md").read_text()


# --- lower dtypes fold in float32, then cast ------------------------------------------------------------------------
def test_bf16_export_equals_float32_export_cast(tmp_path):
    model = trained("llama")
    fp32 = load_file(export_merged(model, tmp_path / "fp32", dtype="fp32", spectrum=False) / "model.safetensors")
    bf16_dir = export_merged(model, tmp_path / "bf16", dtype="bf16", spectrum=False)
    bf16 = load_file(bf16_dir / "model.safetensors")
    assert fp32.keys() == bf16.keys()
    for key in fp32:
        assert bf16[key].dtype == torch.bfloat16 and torch.equal(bf16[key], fp32[key].to(torch.bfloat16)), key
    assert json.loads((bf16_dir / "config.json").read_text())["dtype"] == "bfloat16"
    # a bf16 model exports as bf16 by default, folded from float32 copies of its bf16 weights
    half = trained("llama")
    half.get_base_model().to(torch.bfloat16)
    for _, layer in rotation_layers(half):  # adapters stay float32 under a half-precision base
        layer.poet_R.float(), layer.poet_P.float()
    ref = load_file(export_merged(half, tmp_path / "h32", dtype=torch.float32, spectrum=False) / "model.safetensors")
    got = load_file(export_merged(half, tmp_path / "h16", spectrum=False) / "model.safetensors")
    assert all(torch.equal(got[k], ref[k].to(torch.bfloat16)) for k in ref)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(ref[q], ref[q].to(torch.bfloat16).float())  # the fold really happened in float32


# --- model card ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("spo", ["block", "full"])
def test_model_card_metadata_and_body(tmp_path, spo):
    from huggingface_hub import ModelCard, metadata_load

    model = trained("llama", spo=spo, neumann_terms=4, merge_every=50)
    model.peft_config["default"].base_model_name_or_path = "meta-llama/Llama-3.2-1B"  # a hub id, metadata only
    run = {
        "learning_rate": 1e-3,
        "poet_learning_rate": 5e-4,
        "num_input_tokens_seen": 123456,
        "datasets": ["roneneldan/TinyStories"],
        "eval": {"eval_loss": 2.5, "eval_perplexity": 12.18},
    }
    path = export_merged(model, tmp_path / "export", run_info=run, repo_id="someone/tiny-poet", license="apache-2.0")
    meta = metadata_load(path / "README.md")
    assert meta["library_name"] == "transformers" and meta["license"] == "apache-2.0"
    assert {"poet", "orthogonal", "peft"} <= set(meta["tags"])
    assert meta["base_model"] == "meta-llama/Llama-3.2-1B" and meta["datasets"] == ["roneneldan/TinyStories"]
    assert meta["pipeline_tag"] == "text-generation"
    card = ModelCard.load(path / "README.md")
    assert card.data.license == "apache-2.0"
    body = card.text
    assert "**POET**" in body and "| spo | " + spo + " |" in body
    assert ("| block_size | 16 |" in body) == (spo == "block") and ("| budget | 0.5 |" in body) == (spo == "full")
    for row in (
        "| neumann_terms | 4 |",
        "| merge_every | 50 |",
        "| learning rate | 0.001 |",
        "| POET learning rate | 0.0005 |",
        "| tokens seen | 123,456 |",
        "| merges (merge-then-reinitialize) | 1 |",
        "| eval_loss | 2.5 |",
        "| eval_perplexity | 12.18 |",
    ):
        assert row in body, row
    assert 'AutoModelForCausalLM.from_pretrained("someone/tiny-poet"' in body
    # spectrum rows against an independent float64 SVD of the exported weights
    weights = load_file(path / "model.safetensors")
    for group in ("q_proj", "down_proj"):
        sigma = [torch.linalg.svdvals(w.double()) for k, w in weights.items() if k.endswith(f"{group}.weight")]
        row = re.search(rf"\| `{group}` \| (\d+) \| (\S+) \| (\S+) \| (\S+) \|", body)
        assert row and int(row.group(1)) == len(sigma) == 2
        assert float(row.group(2)) == pytest.approx(float(sum(s.max() for s in sigma) / 2), rel=1e-3)
        assert float(row.group(3)) == pytest.approx(float(sum(s.min() for s in sigma) / 2), rel=1e-3)
        assert float(row.group(4)) == pytest.approx(float(max(s.max() / s.min() for s in sigma)), rel=1e-3)


@pytest.mark.parametrize("name", ["poet.md", "lipconvnet.md", "adapter.md"])
def test_card_templates_are_packaged_and_linked_from_model_cards(name):
    template = template_path(name)
    assert template.is_file() and template.parent.parent.name == "poet_hf"
    assert (REPO / "model_cards" / name).read_text() == template.read_text()
    assert "{{ card_data }}" in template.read_text()


def test_unknown_card_template_names_the_allowed_ones():
    with pytest.raises(ValueError, match=r"template must be one of \('poet.md', 'lipconvnet.md', 'adapter.md'\)"):
        template_path("poet")


# --- interrupted export, overwrite ---------------------------------------------------------------------
@pytest.mark.parametrize("where", ["weights", "card"])
@pytest.mark.parametrize("existing", [False, True])
def test_interrupted_export_leaves_no_partial_output(tmp_path, monkeypatch, where, existing):
    import huggingface_hub
    import transformers.modeling_utils as modeling_utils

    model = trained("llama")
    target = tmp_path / "out" / "export"
    before = None
    if existing:
        export_merged(model, target, spectrum=False)
        before = {p.name: p.read_bytes() for p in target.iterdir()}

    def explode(*args, **kwargs):
        real(*args, **kwargs)  # part of the files is on disk when the failure hits
        raise RuntimeError("injected failure mid-write")

    owner, name = (modeling_utils, "safe_save_file") if where == "weights" else (huggingface_hub.ModelCard, "save")
    real = getattr(owner, name)
    monkeypatch.setattr(owner, name, explode)
    with pytest.raises(RuntimeError, match="injected failure"):
        export_merged(model, target, overwrite=existing, spectrum=False)
    assert [p.name for p in target.parent.iterdir()] == (["export"] if existing else [])  # no temp dirs left
    if existing:
        assert {p.name: p.read_bytes() for p in target.iterdir()} == before


def test_non_empty_output_dir_is_refused_unless_overwrite(tmp_path):
    model = trained("llama")
    target = tmp_path / "export"
    target.mkdir()
    (target / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not empty.*notes.txt.*overwrite"):
        export_merged(model, target)
    assert [p.name for p in target.iterdir()] == ["notes.txt"]
    export_merged(model, target, overwrite=True, spectrum=False)
    assert not (target / "notes.txt").exists()
    assert_plain_export(target)
    assert oct(target.stat().st_mode & 0o777) != oct(0o700)  # not left with mkdtemp's private mode
    empty = tmp_path / "empty"
    empty.mkdir()
    assert_plain_export(export_merged(model, empty, spectrum=False))  # an empty directory is fine


# --- bad sources ---------------------------------------------------------------------------------------------------
def test_sources_that_are_not_poet_models_are_named(tmp_path):
    with pytest.raises(ExportError, match="found a LlamaForCausalLM with no PEFT adapter"):
        export_merged(tiny_llama(), tmp_path / "a")
    lora = get_peft_model(tiny_llama(), LoraConfig(target_modules=["q_proj"]))
    with pytest.raises(ExportError, match="PEFT type is .*LORA"):
        export_merged(lora, tmp_path / "b")
    lora.save_pretrained(tmp_path / "lora")
    with pytest.raises(ExportError, match="lora/adapter_config.json is not a POET/OFT model.*LORA"):
        export_merged(tmp_path / "lora", tmp_path / "c")
    tiny_llama().save_pretrained(tmp_path / "plain")
    with pytest.raises(ExportError, match="no adapter_config.json.*plain transformers model"):
        export_merged(tmp_path / "plain", tmp_path / "d")
    (tmp_path / "run" / "checkpoint-2").mkdir(parents=True)
    (tmp_path / "run" / "checkpoint-10").mkdir()
    with pytest.raises(ExportError, match="training checkpoints.*checkpoint-10"):
        export_merged(tmp_path / "run", tmp_path / "e")
    with pytest.raises(FileNotFoundError):
        export_merged(tmp_path / "missing", tmp_path / "f")
    with pytest.raises(ExportError, match="`dtype` must be one of bf16/bfloat16"):
        export_merged(tmp_path / "lora", tmp_path / "g", dtype="int8")
    assert not any((tmp_path / n).exists() for n in "abcdefg")


def test_partial_checkpoint_without_base_is_refused(tmp_path):
    model = trained("llama")  # fine-tuning: the adapter file does not hold embeddings and norms
    model.peft_config["default"].base_model_name_or_path = None
    model.save_pretrained(tmp_path / "ckpt")
    model.get_base_model().config.save_pretrained(tmp_path / "ckpt")
    with pytest.raises(ExportError, match="holds only part of the model.*base weights missing"):
        export_merged(tmp_path / "ckpt", tmp_path / "out")
    assert not (tmp_path / "out").exists()


# --- pushing, through huggingface_hub, to a stand-in for the Hub ---------------------------------------
def hub_env(tmp_path: Path, endpoint: str, token: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(
        {
            "HF_ENDPOINT": endpoint,
            "HF_HOME": str(tmp_path / "hf_home"),
            "HF_HUB_DISABLE_TELEMETRY": "1",
            "OMP_NUM_THREADS": str(torch.get_num_threads()),
            "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        }
    )
    if token:
        env["HF_TOKEN"] = token
    return env


def run_cli(args: list[str], env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "scripts" / "export.py"), *map(str, args)],
        env=env,
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT,
        cwd=REPO,
    )


def folder_bytes(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def test_cli_exports_and_pushes_through_huggingface_hub_to_a_stand_in(tmp_path, adapter_dir):
    adapter_dir, _ = adapter_dir
    with StandInHub() as hub:
        done = run_cli(
            [
                adapter_dir,
                tmp_path / "export",
                "--push-to-hub",
                "--hub-model-id",
                "someone/tiny-poet",
                "--hub-private-repo",
                "--dtype",
                "fp32",
            ],
            hub_env(tmp_path, hub.url, token="hf_stand_in_token"),
        )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "pushed" in done.stdout
    paths = [c["path"] for c in hub.calls]
    assert paths == [
        "/api/repos/create",
        "/api/validate-yaml",
        "/api/models/someone/tiny-poet/preupload/main",
        "/api/models/someone/tiny-poet/commit/main",
    ]
    assert all(c["auth"] == "Bearer hf_stand_in_token" for c in hub.calls)
    create = json.loads(hub.calls[0]["body"])
    assert create == {"name": "tiny-poet", "organization": "someone", "visibility": "private", "type": "model"}
    on_disk = folder_bytes(tmp_path / "export")
    assert {"config.json", "model.safetensors", "README.md", "tokenizer.json"} <= set(on_disk)
    assert hub.files == on_disk  # every exported file arrived, byte for byte


def test_cli_without_token_fails_before_exporting_and_touches_nothing(tmp_path, adapter_dir):
    adapter_dir, _ = adapter_dir
    existing = export_merged(adapter_dir, tmp_path / "export", spectrum=False)
    before = folder_bytes(existing)
    with StandInHub() as hub:
        done = run_cli(
            [adapter_dir, existing, "--overwrite", "--push-to-hub", "--hub_model_id", "someone/tiny-poet"],
            hub_env(tmp_path, hub.url, token=None),
        )
    assert done.returncode == 2
    assert "no Hugging Face token" in done.stderr and "HF_TOKEN" in done.stderr
    assert hub.calls == [] and folder_bytes(existing) == before


@pytest.mark.parametrize(
    "argv, message",
    [
        (["only-a-source"], "the following arguments are required: output_dir"),
        (["a", "b", "--dtype", "int4"], "argument --dtype: `dtype` must be one of"),
    ],
)
def test_cli_argument_errors_are_one_line_with_exit_status_2(capsys, argv, message):
    from script_modules import command_line_error, load_module

    script = load_module(Path(__file__).resolve().parent.parent / "scripts" / "export.py")
    assert message in command_line_error(capsys, lambda: script.main(argv))


def test_cli_without_network_keeps_the_complete_export(tmp_path, adapter_dir):
    adapter_dir, _ = adapter_dir
    reference = export_merged(adapter_dir, tmp_path / "reference", repo_id="someone/tiny-poet")
    with socket.socket() as sock:  # a port with nothing listening: connection refused
        sock.bind(("127.0.0.1", 0))
        env = hub_env(tmp_path, f"http://127.0.0.1:{sock.getsockname()[1]}", token="hf_stand_in_token")
        done = run_cli([adapter_dir, tmp_path / "export", "--push_to_hub", "--hub_model_id", "someone/tiny-poet"], env)
    assert done.returncode == 3, done.stderr[-3000:]
    assert "could not reach the Hub" in done.stderr and "is complete and untouched" in done.stderr
    assert folder_bytes(tmp_path / "export") == folder_bytes(reference)  # the full export, byte for byte


def test_push_errors_from_the_hub_are_readable_and_leave_the_folder(tmp_path, monkeypatch):
    import huggingface_hub

    export = export_merged(trained("llama"), tmp_path / "export", spectrum=False)
    before = folder_bytes(export)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)  # no saved login either
    with pytest.raises(HubPushError, match="no Hugging Face token .*HF_TOKEN"):
        push_merged_to_hub(export, "someone/tiny-poet", endpoint="http://127.0.0.1:9")
    with StandInHub(missing_repo=True) as hub:
        reach_stand_in(monkeypatch, hub)
        with pytest.raises(HubPushError, match="no model repo 'someone/data' .*dataset or Space"):
            push_merged_to_hub(export, "someone/data", token="hf_stand_in_token", endpoint=hub.url)
    assert folder_bytes(export) == before
    with pytest.raises(HubPushError, match="does not look like an export"):
        push_merged_to_hub(tmp_path, "someone/x", token="t", endpoint="http://127.0.0.1:9")


def test_an_export_does_not_depend_on_the_exporting_machines_offline_mode(tmp_path, adapter_dir, monkeypatch):
    """transformers records how a tokenizer was loaded (``local_files_only``, which ``HF_HUB_OFFLINE`` turns on) in
    its ``tokenizer_config.json``; an export leaves it out, so online and offline machines write the same files."""
    import huggingface_hub.constants

    adapter_dir, _ = adapter_dir
    modes = {}
    for offline in (False, True):
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", offline)
        modes[offline] = folder_bytes(
            export_merged(adapter_dir, tmp_path / f"offline-{offline}" / "export", spectrum=False)
        )
    assert modes[True] == modes[False]
    assert "local_files_only" not in json.loads(modes[True]["tokenizer_config.json"])
