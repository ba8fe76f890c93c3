"""Models built on the meta device and materialized (``poet_hf.initialization``): sharded by two FSDP2 processes
(gloo) or whole, from keyed initialisation or from a checkpoint, they equal, bit for bit, the model built the plain
way: the base materialized in one process, the adapters added to real weights (or ``from_pretrained``)."""

import json
from pathlib import Path

import prewarmed
import pytest
import torch
from models import TINY_LLAMA
from peft import LoraConfig, get_peft_model
from training_utils import meta_poet_model, randomize_rotations
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

import poet_hf  # noqa: F401
from poet_hf import OftConfig, PoetConfig, merge_and_reinit
from poet_hf.initialization import has_meta_tensors, materialize_model
from poet_hf.tuners.rotation.layer import rotation_layers

# One xdist worker runs every test here (pyproject: --dist loadgroup), so the module's 2-rank run happens once.
pytestmark = pytest.mark.xdist_group("materialize")

HERE = Path(__file__).resolve().parent


def plain_poet_model(spo: str, base_init="normalized", **poet_kwargs):
    """The plain build: the base materialized whole, then the adapters added to its real weights."""
    with torch.device("meta"):
        base = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA))
    materialize_model(base, seed=3)
    fields = {"spo": spo, "block_size": 8, "budget": 0.5, "base_init": base_init, "init_weights": False, **poet_kwargs}
    return get_peft_model(base, PoetConfig(**fields))


def state_of(model) -> dict[str, torch.Tensor]:
    return {**model.state_dict(), **{f"buffer:{name}": b for name, b in model.named_buffers()}}


def assert_identical(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]) -> None:
    assert sorted(expected) == sorted(actual)
    different = [k for k in expected if not torch.equal(expected[k], actual[k])]
    assert not different, different[:5]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny LLaMA checkpoint with weights no initialisation would give."""
    folder = tmp_path_factory.mktemp("checkpoint")
    torch.manual_seed(5)
    model = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA))
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.rand_like(param))
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def sharded(tmp_path_factory, checkpoint):
    """The four cases of tests/workers/materialize_worker.py, run once by two processes: their output folder."""
    out = tmp_path_factory.mktemp("sharded")
    prewarmed.run(HERE / "workers" / "materialize_worker.py", [out, checkpoint], out / "worker.log", ranks=2)
    return out


def largest_shares(folder: Path) -> list[float]:
    return [json.loads((folder / f"rank{rank}.json").read_text())["largest_share"] for rank in (0, 1)]


# No process holds any parameter whole: at most ⌈n/2⌉ of n rows, the odd vocabulary's 49 of 97 the largest share
# (POET-FS's one-row skew vectors are split along their long dimension).
HALF = (TINY_LLAMA["vocab_size"] + 1) / (2 * TINY_LLAMA["vocab_size"])


@pytest.mark.slow
@pytest.mark.parametrize("spo", ["block", "full"])
def test_a_meta_built_sharded_model_equals_the_plain_model_at_init_and_after_two_merges(sharded, spo):
    folder = sharded / f"init-{spo}"
    assert max(largest_shares(folder)) <= HALF
    plain = plain_poet_model(spo)
    assert_identical(state_of(plain), torch.load(folder / "init.pt"))
    for merge in (1, 2):
        randomize_rotations(plain, merge)
        merge_and_reinit(plain)
        assert_identical(state_of(plain), torch.load(folder / f"merge{merge}.pt"))
    assert int(plain.base_model.model.model.layers[0].mlp.up_proj.poet_merge_count["default"]) == 2


@pytest.mark.slow
@pytest.mark.parametrize("loading", ["scatter", "broadcast"])
def test_a_checkpoint_loaded_shard_by_shard_equals_one_loaded_whole(sharded, checkpoint, loading):
    folder = sharded / f"checkpoint-{loading}"
    assert max(largest_shares(folder)) <= HALF
    whole = get_peft_model(
        AutoModelForCausalLM.from_pretrained(checkpoint), PoetConfig(spo="full", budget=0.5, init_weights=False)
    )
    assert_identical(state_of(whole), torch.load(folder / "init.pt"))


@pytest.mark.parametrize("spo", ["block", "full"])
def test_adapters_added_on_meta_then_materialized_equal_adapters_added_to_real_weights(spo):
    meta = meta_poet_model(spo)
    assert has_meta_tensors(meta)
    materialize_model(meta, seed=3, device="cpu")
    assert not has_meta_tensors(meta)
    assert_identical(state_of(plain_poet_model(spo)), state_of(meta))


def test_one_process_materializes_a_checkpoint_as_from_pretrained_does(checkpoint):
    meta = meta_poet_model("block", base_init=None, config_from=str(checkpoint))
    materialize_model(meta, seed=3, checkpoint=checkpoint)
    whole = get_peft_model(
        AutoModelForCausalLM.from_pretrained(checkpoint), PoetConfig(spo="block", block_size=8, init_weights=False)
    )
    assert_identical(state_of(whole), state_of(meta))


def test_the_keyed_initialisation_is_transformers_own():
    """Against the model transformers builds the usual way: the same deterministic tensors (norms, rotary
    frequencies), the same distribution for the random ones, and identity adapters when ``init_weights`` is set."""
    with torch.device("meta"):
        meta = get_peft_model(LlamaForCausalLM(LlamaConfig(**TINY_LLAMA)), PoetConfig(block_size=8))
    materialize_model(meta, seed=0)
    usual = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA))
    base = meta.get_base_model()
    assert torch.equal(base.model.rotary_emb.inv_freq, usual.model.rotary_emb.inv_freq)
    assert torch.equal(base.model.norm.weight, torch.ones(32))
    embedding = base.model.embed_tokens.weight
    # sample std of n normal draws: relative standard error 1/sqrt(2n); 5 of them
    assert abs(float(embedding.std()) / 0.02 - 1) <= 5 / (2 * embedding.numel()) ** 0.5
    skew = [p for n, p in meta.named_parameters() if ".poet_" in n]
    assert skew and all(not p.any() for p in skew)  # init_weights=True: zero skew vectors, the identity


def test_materialized_tied_embeddings_stay_tied():
    with torch.device("meta"):
        model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2, n_positions=16))
    materialize_model(model, seed=0)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert not has_meta_tensors(model)


def test_materialized_oft_equals_oft_added_to_real_weights():
    config = OftConfig(block_size=8, init_weights=False, target_modules=["q_proj", "v_proj"])
    with torch.device("meta"):
        meta = get_peft_model(LlamaForCausalLM(LlamaConfig(**TINY_LLAMA)), config)
    materialize_model(meta, seed=1)
    with torch.device("meta"):
        base = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA))
    plain = get_peft_model(materialize_model(base, seed=1), config)
    assert_identical(state_of(plain), state_of(meta))


def test_materialize_refuses_what_it_cannot_initialise(tmp_path, checkpoint):
    with torch.device("meta"):
        lora = get_peft_model(LlamaForCausalLM(LlamaConfig(**TINY_LLAMA)), LoraConfig(target_modules=["q_proj"]))
    with pytest.raises(ValueError, match="LoRA|Linear.*adapter on the meta device"):
        materialize_model(lora)
    with pytest.raises(ValueError, match="`loading` must be one of"):
        materialize_model(meta_poet_model("block"), loading="gather")
    with pytest.raises(FileNotFoundError, match="neither model.safetensors"):
        materialize_model(meta_poet_model("block"), checkpoint=tmp_path)
    bigger = {**TINY_LLAMA, "num_hidden_layers": 3}
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**bigger))
    with pytest.raises(ValueError, match=r"lacks \d+ tensors of the model, e.g. \['model.layers.2"):
        materialize_model(model, checkpoint=checkpoint)


@pytest.mark.parametrize("quantization", ["nf4", "int8"])
def test_a_quantised_base_is_built_on_meta_and_quantised_one_layer_at_a_time(monkeypatch, quantization):
    """``base_quantization`` on a meta model: materialize_model initialises each layer and quantises it before the
    next one gets storage (never more than one float32 W0 alive), and ends with the codes, scales and adapters of
    the plain build (a materialized base, quantised when the adapter is added)."""
    plain = plain_poet_model("block", base_quantization=quantization)
    with torch.device("meta"):
        base = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA))
    fields = {"spo": "block", "block_size": 8, "base_init": "normalized", "init_weights": False}
    meta = get_peft_model(base, PoetConfig(**fields, base_quantization=quantization))
    layers = [layer for _, layer in rotation_layers(meta)]
    dense_alive = []
    quantize_base = type(layers[0]).quantize_base

    def counting(layer, quantization):
        dense_alive.append(sum(type(x.get_base_layer()) is torch.nn.Linear and not has_meta_tensors(x) for x in layers))
        quantize_base(layer, quantization)

    monkeypatch.setattr(type(layers[0]), "quantize_base", counting)
    materialize_model(meta, seed=3)
    assert dense_alive == [1] * len(layers)
    assert_identical(state_of(plain), state_of(meta))


def test_poet_trainer_materializes_a_meta_model_from_pretrained_weights(tmp_path, checkpoint):
    from poet_hf import PoetTrainer, PoetTrainingArguments

    meta = meta_poet_model("block", base_init=None, config_from=str(checkpoint))
    args = PoetTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", seed=3)
    PoetTrainer(model=meta, args=args, pretrained_weights=str(checkpoint))
    assert not has_meta_tensors(meta)
    whole = get_peft_model(
        AutoModelForCausalLM.from_pretrained(checkpoint), PoetConfig(spo="block", block_size=8, init_weights=False)
    )
    assert_identical(state_of(whole), state_of(meta))


def test_a_tensor_no_initialisation_writes_is_an_error_not_garbage():
    class Scale(torch.nn.Module):  # a plain module with a parameter and no reset_parameters
        def __init__(self) -> None:
            super().__init__()
            self.gain = torch.nn.Parameter(torch.ones(4))

    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), Scale())
    with pytest.raises(ValueError, match=r"'1' \(Scale\) is on the meta device.*\['gain'\]"):
        materialize_model(model)
    with torch.device("meta"):
        plain = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    materialize_model(plain, seed=0)  # torch's own reset_parameters, keyed
    assert torch.equal(plain[1].weight, torch.ones(4)) and plain[0].weight.abs().max() <= 0.5  # U(±1/√4)


def test_finetuning_under_fsdp2_builds_on_meta_and_reads_the_checkpoint_shard_by_shard(monkeypatch, checkpoint):
    """What scripts/finetune.py does when Accelerate will shard (an accelerator and an FSDP launch; faked here, the
    sharding itself is tested above): the model is built on meta, and PoetTrainer is told where its weights are."""
    from poet_hf.recipes import finetune

    args = finetune.FinetuneArguments(model_name_or_path=str(checkpoint), method="poet")
    assert not has_meta_tensors(finetune.load_model(args)[0])  # not sharded: from_pretrained, as always
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    model, new_modules = finetune.load_model(args)
    assert has_meta_tensors(model) and new_modules == []
    assert finetune.local_weights(str(checkpoint)) == str(checkpoint)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    materialize_model(model, checkpoint=finetune.local_weights(str(checkpoint)), device="cpu")
    assert_identical(AutoModelForCausalLM.from_pretrained(checkpoint).state_dict(), model.state_dict())
