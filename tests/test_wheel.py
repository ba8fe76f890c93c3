"""The package as a user installs it: a wheel built from the tree, installed with pip into a new virtual environment,
used from a folder outside the checkout through its ``poet-hf`` entry point and ``accelerate launch -m poet_hf``.

The new environment takes the wheel alone (``--no-deps --no-index``); its dependencies come from this test's own
environment through a ``.pth`` line, so no package is downloaded and the checkout's editable install (a finder that
only this environment's site folder loads) is not seen. Every command checks which ``poet_hf`` it imported.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.xdist_group("wheel")  # one wheel and environment for both tests
QUICK_RUN = ["--max_steps", "2", "--save_steps", "2", "--max_eval_samples", "8", "--seq_len", "64"]


def _run(command: list[str], cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env |= {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, (command, done.stdout[-2000:], done.stderr[-3000:])
    return done


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A new virtual environment with the wheel of this tree installed; its folder."""
    scratch = tmp_path_factory.mktemp("wheel")
    source = scratch / "source"  # the build writes egg-info and build/ beside its sources: a copy, not the checkout
    shutil.copytree(ROOT / "src", source / "src", ignore=shutil.ignore_patterns("*.egg-info", "__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(scratch / "dist"), str(source)], scratch)
    (wheel,) = (scratch / "dist").glob("poet_hf-*.whl")
    venv = scratch / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], scratch)
    site = Path(next((venv / "lib").glob("python*/site-packages")))
    (site / "test_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], scratch)
    return venv


@pytest.mark.slow
def test_the_installed_wheel_pretrains_plans_exports_and_loads_outside_the_checkout(installed, tmp_path):
    python, poet_hf = str(installed / "bin" / "python"), str(installed / "bin" / "poet-hf")
    where = _run([python, "-c", "import poet_hf, pathlib; print(pathlib.Path(poet_hf.__file__).parent)"], tmp_path)
    assert Path(where.stdout.strip()).is_relative_to(installed), where.stdout  # the wheel's copy, not the checkout
    trained = _run([poet_hf, "pretrain", *QUICK_RUN, "--output_dir", "run"], tmp_path)
    assert "validation perplexity:" in trained.stdout
    assert json.loads((tmp_path / "run" / "results.json").read_text())["steps"] == 2
    plan = _run([poet_hf, "plan-memory", "--preset", "tiny", "--per_device_train_batch_size", "2"], tmp_path)
    assert plan.stdout.strip().splitlines()[-1].startswith("total: ")
    _run([poet_hf, "export", "run/checkpoint-2", "exported", "--no_spectrum"], tmp_path)
    load = (
        "import torch, transformers, peft, poet_hf\n"
        "plain = transformers.AutoModelForCausalLM.from_pretrained('exported')\n"  # stock transformers
        "base = transformers.LlamaForCausalLM(transformers.LlamaConfig(vocab_size=64, hidden_size=32, "
        "intermediate_size=64, num_hidden_layers=1, num_attention_heads=2))\n"
        "peft.get_peft_model(base, poet_hf.PoetConfig(block_size=8)).save_pretrained('adapter')\n"
        "loaded = peft.PeftModel.from_pretrained(base, 'adapter')\n"  # the tuners registered with PEFT
        "print(type(plain).__name__, type(loaded.peft_config['default']).__name__)\n"
    )
    assert _run([python, "-c", load], tmp_path).stdout.split() == ["LlamaForCausalLM", "PoetConfig"]


@pytest.mark.slow
def test_accelerate_launch_runs_the_installed_module(installed, tmp_path):
    """``accelerate launch -m poet_hf pretrain``: the documented launcher, with the module instead of the script."""
    launch = [str(installed / "bin" / "python"), "-m", "accelerate.commands.launch", "--num_processes", "1", "--cpu"]
    done = _run([*launch, "-m", "poet_hf", "pretrain", *QUICK_RUN, "--output_dir", "run"], tmp_path)
    assert "validation perplexity:" in done.stdout
    assert (tmp_path / "run" / "checkpoint-2").is_dir()
