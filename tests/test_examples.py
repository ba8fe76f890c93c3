"""Every script in examples/ runs at its defaults (shortened where the figure checked does not need the full run) and
is checked on a real number: the loss falls, a reloaded adapter or a merged / exported model computes what the
trained adapter model computes, certificates hold after a reload; the cluster launch files are checked against
scripts/pretrain.py, and the CPU ones run."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from hub_stand_in import StandInHub, reach_stand_in
from script_modules import load_module
from tolerances import tiny_model_tolerance
from training_utils import free_port

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
CLUSTER = EXAMPLES / "cluster"
# Two evaluations of one model on one input, through folds that reassociate at most the tiny models' sums.
TOLERANCE = tiny_model_tolerance(torch.float32)


def example(name: str):
    return load_module(EXAMPLES / f"{name}.py")


@pytest.mark.slow
@pytest.mark.parametrize("method", ["oft", "poet"])
def test_sft_with_trl_lowers_the_loss_and_the_saved_adapter_reloads(tmp_path, method):
    sft = example("sft_trl")
    result = sft.run(sft.parse_args(["--method", method, "--max_steps", "20", "--output_dir", str(tmp_path)]))
    assert result["eval_loss_after"] < result["eval_loss_before"] - 0.02
    assert result["reload_max_abs_gap"] == 0.0  # the same weights, the same computation
    assert (tmp_path / "adapter" / "adapter_config.json").exists()


@pytest.mark.slow
def test_diffusers_unet_with_oft_learns_its_subject_and_merges_into_a_plain_unet(tmp_path):
    unet = example("diffusers_unet_oft")
    result = unet.run(unet.parse_args(["--max_steps", "30", "--output_dir", str(tmp_path)]))
    assert result["denoising_loss_after"] < 0.5 * result["denoising_loss_before"]
    assert result["reload_max_abs_gap"] == 0.0
    assert result["merged_class"] == "UNet2DConditionModel"
    assert result["merged_max_abs_gap"] <= TOLERANCE * result["output_scale"]


@pytest.mark.slow
def test_poet_on_a_vision_transformer_and_a_plain_module(tmp_path):
    vit = example("poet_vit")
    result = vit.run(vit.parse_args(["--num_train_epochs", "2", "--output_dir", str(tmp_path)]))
    assert result["vit_merges"] >= 2
    assert result["vit_accuracy_after"] > result["vit_accuracy_before"] + 0.3  # ten classes: chance is 0.1
    assert result["vit_merged_class"] == "ViTForImageClassification"
    assert result["vit_merged_max_abs_gap"] <= TOLERANCE * result["vit_logit_scale"]
    assert result["mlp_accuracy_after"] > result["mlp_accuracy_before"] + 0.3


@pytest.mark.slow
def test_lipconvnet_is_certified_reloaded_and_pushed_to_a_hub(tmp_path, monkeypatch):
    lipconvnet = example("lipconvnet_certified")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    with StandInHub() as hub:
        reach_stand_in(monkeypatch, hub)
        monkeypatch.setenv("HF_TOKEN", "hf_stand_in_token")
        result = lipconvnet.run(
            lipconvnet.parse_args(
                [
                    "--num_train_epochs",
                    "2",
                    "--output_dir",
                    str(tmp_path / "model"),
                    "--push_to_hub",
                    "--hub_model_id",
                    "someone/lipconvnet-5",
                ]
            )
        )
    at = result["certified_accuracy_at"]
    assert at["1.0"] <= at["108/255"] <= at["72/255"] <= at["36/255"] <= result["clean_accuracy"]
    assert result["certified_accuracy"] > 0.5  # ten classes: chance is 0.1
    assert (result["reloaded_clean_accuracy"], result["reloaded_certified_accuracy"]) == (
        result["clean_accuracy"],
        result["certified_accuracy"],
    )
    assert result["reloaded_lipschitz_constant"] == result["lipschitz_constant"]
    assert {"config.json", "model.safetensors", "README.md"} <= set(hub.files)
    assert "someone/lipconvnet-5/commit/" in result["commit_url"]


@pytest.mark.slow
def test_qoft_on_a_4bit_base_trains_reloads_and_exports_a_plain_model(tmp_path):
    qoft = example("qoft_4bit")
    result = qoft.run(qoft.parse_args(["--max_steps", "20", "--output_dir", str(tmp_path)]))
    assert result["base_layer"] == "Linear4bit"
    assert result["eval_loss_after"] < result["eval_loss_before"] - 0.05
    assert result["reload_max_abs_gap"] == 0.0
    # float32 folds of the dequantized W0 against the fused 4-bit forward: rounding of the same products
    assert result["export_max_abs_gap"] <= TOLERANCE * result["logit_scale"]
    assert not result["export_has_quantization"]


# --- cluster launch files ------------------------------------------------------------------------------------------
def launch_config(name: str) -> dict:
    return yaml.safe_load((CLUSTER / name).read_text())


@pytest.mark.parametrize("name", sorted(p.name for p in CLUSTER.glob("*.yaml")))
def test_each_accelerate_config_is_one_pretrain_py_accepts(name):
    """Loaded by accelerate's own config class; a sharded config is what PoetTrainer takes (FSDP2, sharded state
    dicts, no rank-0 loading: the model is built on meta and materialized shard by shard); the process count is
    machines × processes per machine."""
    from accelerate.commands.config.config_args import ClusterConfig

    from poet_hf.training.trainer import check_sharding

    config = ClusterConfig.from_yaml_file(str(CLUSTER / name))
    raw = launch_config(name)
    assert config.distributed_type in ("NO", "MULTI_GPU", "FSDP", "DEEPSPEED")
    fsdp = config.distributed_type == "FSDP"
    check_sharding(fsdp, fsdp_version=raw.get("fsdp_config", {}).get("fsdp_version"))
    if fsdp:
        options = raw["fsdp_config"]
        assert options["fsdp_transformer_layer_cls_to_wrap"] == "LlamaDecoderLayer"  # pretrain.py's model
        assert options["fsdp_state_dict_type"] == "SHARDED_STATE_DICT" and not options["fsdp_cpu_ram_efficient_loading"]
    if config.distributed_type == "DEEPSPEED":  # trained in 2 CPU processes by tests/test_deepspeed.py
        options = raw["deepspeed_config"]
        if "deepspeed_config_file" in options:  # relative to the repository's root, where the docs launch it
            options = json.loads((CLUSTER.parent.parent / options["deepspeed_config_file"]).read_text())
            assert not {"optimizer", "scheduler"} & set(options)  # the trainer's: POET's two rates
            zero = options["zero_optimization"]
            assert zero["stage"] == 3 and zero["stage3_gather_16bit_weights_on_model_save"]
            sizes = ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold")
            assert all(zero[key] == "auto" for key in sizes)  # the model's width, not DeepSpeed's defaults
        else:
            assert "optimizer" not in options and options["zero_stage"] in (2, 3)
    assert config.num_processes % config.num_machines == 0
    assert config.use_cpu == name.startswith("cpu")


def pretrain_arguments(output_dir: Path) -> list[str]:
    return [
        "--max_steps",
        "2",
        "--per_device_train_batch_size",
        "2",
        "--global_batch_size",
        "4",
        "--seq_len",
        "64",
        "--merge_every",
        "1",
        "--max_eval_samples",
        "4",
        "--logging_steps",
        "1",
        "--output_dir",
        str(output_dir),
    ]


def test_the_cpu_config_runs_pretrain_py(tmp_path):
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(CLUSTER / "cpu.yaml"),
        "--main_process_port",
        str(free_port()),
        str(REPO / "scripts" / "pretrain.py"),
        *pretrain_arguments(tmp_path),
    ]
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["recipe"]["processes"] == 1 and results["merges"] == 2


@pytest.mark.slow
def test_the_slurm_script_launches_pretrain_py_on_every_node(tmp_path):
    """slurm_pretrain.sh under a stand-in for SLURM (an `srun` that runs its command as node 0, an `scontrol` that
    names this host), with the 2-process CPU config: pretrain.py trains under DDP and writes its results."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fakes = {
        "srun": '#!/usr/bin/env bash\nwhile [[ "$1" == --* ]]; do shift; done\nSLURM_NODEID=0 exec "$@"\n',
        "scontrol": "#!/usr/bin/env bash\necho 127.0.0.1\n",
    }
    for name, body in fakes.items():
        (bin_dir / name).write_text(body)
        (bin_dir / name).chmod(stat.S_IRWXU)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "SLURM_NNODES": "1",
        "SLURM_JOB_NODELIST": "localhost",
        "GPUS_PER_NODE": "2",
        "PORT": str(free_port()),
        "CONFIG": str(CLUSTER / "cpu_ddp.yaml"),
        "OMP_NUM_THREADS": "1",
    }
    result = subprocess.run(
        ["bash", str(CLUSTER / "slurm_pretrain.sh"), *pretrain_arguments(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["recipe"]["processes"] == 2 and results["merges"] == 2
    assert results["val_loss"] < results["initial_val_loss"]
