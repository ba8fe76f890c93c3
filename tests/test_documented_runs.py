"""Every command line of the README's and docs/' ``bash`` blocks that can run on this machine runs, in page order, in
one working folder, so that a page that is a path (pretrain → export → push) is tested as one and a page that uses
another's output (docs/export.md exports the README's run) finds it.

A line runs as written, plus the few flags that shorten it (`QUICK`), which the page itself gives to a reader who
wants to try it in seconds (a test checks that it does). A line that cannot run here (a GPU, a cluster, a Hub
download, the user's own model) is skipped with its reason (`NOT_HERE`), printed by ``pytest -rs``; every such line
is still parsed by its script's own parser in tests/test_documented_commands.py.

Python scripts and ``poet-hf`` run forked from a server that has already imported torch, transformers and PEFT
(tests/helpers/prewarmed.py): the script runs as ``__main__`` with the line's arguments, in the working folder, as
``python scripts/...`` would, without 14 s of imports each. ``accelerate launch`` lines go through accelerate's
own launcher, which reads their config files and flags and prepares the ranks' environment (a free
``--main_process_port`` added), and their ranks are forked from the same server. Pushes go to a stand-in for the Hub
on 127.0.0.1 (tests/helpers/hub_stand_in.py), which records what each commits.
"""

from __future__ import annotations

import re
from pathlib import Path

import prewarmed
import pytest
from documented_commands import PAGES, commands, page_lines, script_call
from hub_stand_in import StandInHub
from script_modules import ROOT
from training_utils import free_port

# The flags that shorten a run, per script: each page that has a line of that script says them to its reader.
QUICK = {
    "scripts/pretrain": "--max_steps 2 --per_device_train_batch_size 1 --gradient_accumulation_steps 1 "
    "--max_eval_samples 2",
    "scripts/train_vision": "--max_steps 2 --per_device_train_batch_size 8 --max_eval_samples 32",
    "scripts/train_svd_network": "--num_train_epochs 1",
    "examples/sft_trl": "--max_steps 2",
    "examples/diffusers_unet_oft": "--max_steps 2",
    "examples/qoft_4bit": "--max_steps 2",
    "examples/poet_vit": "--num_train_epochs 1",
    "examples/lipconvnet_certified": "--num_train_epochs 1",
}
HUB_REFERENCE = re.compile(r"--(?:config_name|model_name_or_path|tokenizer_name)[ =](?!\./|configs/|runs/|outputs/)\S")
# Why a line does not run here, the first that matches.
NOT_HERE = [
    (r"^pip wheel", "builds and installs the wheel: tests/test_wheel.py does, in a new virtual environment"),
    (r"^pip |python -m pytest", "the set-up and the tests: .ci/run runs them as README.md writes them"),
    (r"^(pre-commit|ruff|mypy|mkdocs|find tests)\b|tolerance_audit|POET_TOLERANCE_AUDIT", "the toolbelt: .ci/run"),
    (r"scripts/benchmark\.py", "a benchmark suite: minutes to hours on a quiet machine (docs/benchmarks.md)"),
    (r"^sbatch ", "a SLURM cluster: tests/test_examples.py runs slurm_pretrain.sh under a stand-in srun"),
    (r"^(vllm|docker) |sglang", "a serving engine on a GPU"),
    (r"gpu_check|(?<!cpu_)ddp\.yaml|fsdp2\.yaml|deepspeed_zero[23]\.yaml", "needs CUDA GPUs"),
    (r"allenai/c4|uoft-cs/|--dataset glue|mnist-5k", "downloads a dataset from the Hub"),
    (HUB_REFERENCE.pattern, "downloads a model, config or tokenizer from the Hub"),
    (r"\./my-|path/to/|runs/my-|\./corpus", "names the reader's own model or data"),
    (r"--method galore", "needs galore-torch, which [dev] leaves out"),
    (r"--torch_compile", "inductor builds its C++ kernels for minutes on a CPU; tests/test_compile.py trains compiled"),
]
LINES = [(page, index, line) for page in PAGES for index, line in enumerate(page_lines(page))]


def _reason(line: str) -> str | None:
    return next((why for pattern, why in NOT_HERE if re.search(pattern, line)), None)


def _first_place(entry: tuple[Path, int, str]) -> str | None:
    """Where the same commands (comments aside) run first, when an earlier line of the pages holds them."""
    first = next(earlier for earlier in LINES if commands(earlier[2]) == commands(entry[2]))
    return None if first[:2] == entry[:2] else f"{first[0].relative_to(ROOT)}:{first[1]}"


def _id(page: Path, index: int, line: str) -> str:
    return f"{page.relative_to(ROOT)}:{index}:{line[:50]}"


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """The reader's checkout as the pages assume it (scripts/, examples/, configs/ beside the outputs), and the
    stand-in Hub every push of the module goes to."""
    folder = tmp_path_factory.mktemp("reader")
    for name in ("scripts", "examples", "configs"):
        (folder / name).symlink_to(ROOT / name)
    with StandInHub() as hub:
        env = {"HF_ENDPOINT": hub.url, "HF_TOKEN": "hf_stand_in_token", "HF_HOME": str(folder / ".hf_home")}
        yield folder, hub, env


def _quick(script: str, page: Path) -> list[str]:
    flags = QUICK.get(script, "")
    assert f"`{flags}`" in page.read_text() or not flags, f"{page.name} must tell its reader `{flags}`"
    return flags.split()


def _launch(command: list[str], script: str, page: Path, folder: Path, env: dict[str, str], log: Path) -> None:
    """``accelerate launch ...`` with a free port and the quick flags: accelerate's launcher prepares the ranks, which
    are forked from the server (tests/helpers/prewarmed.py)."""
    index = command.index("launch") + 1
    arguments = ["--main_process_port", str(free_port()), *command[index:], *_quick(script, page)]
    prewarmed.accelerate_launch(arguments, log, env={**env, "OMP_NUM_THREADS": "1"}, cwd=folder)


def _run(command: list[str], page: Path, folder: Path, env: dict[str, str], log: Path) -> None:
    call = script_call(command)
    assert call is not None, f"{page.name}: {' '.join(command)} calls no script of this repository"
    script, first = call
    if command[:2] == ["accelerate", "launch"]:
        return _launch(command, script, page, folder, env, log)
    program = "-m poet_hf" if command[0] == "poet-hf" or "-m" in command[:first] else str(ROOT / f"{script}.py")
    arguments = command[first - 1 :] if program == "-m poet_hf" else command[first:]
    prewarmed.run(program, [*arguments, *_quick(script, page)], log, env=env, cwd=folder)


@pytest.mark.xdist_group("documented_runs")
@pytest.mark.parametrize("page, index, line", LINES, ids=[_id(*entry) for entry in LINES])
def test_a_documented_line_runs_as_written(page, index, line, workspace):
    if (reason := _reason(line)) is not None:
        pytest.skip(f"{page.relative_to(ROOT)}: {reason}: {line}")
    if (first := _first_place((page, index, line))) is not None:
        pytest.skip(f"{page.relative_to(ROOT)}: the same command as {first}, which runs there: {line}")
    folder, hub, env = workspace
    calls = len(hub.calls)
    for command in commands(line):
        _run(command, page, folder, env, folder / "logs" / f"{page.stem}-{index}.log")
    if "--push_to_hub" in line:  # one commit to the repo the line names, with the model in it
        repo = line.split("--hub_model_id ")[1].split()[0]
        commits = [call for call in hub.calls[calls:] if call["path"].startswith(f"/api/models/{repo}/commit/")]
        assert len(commits) == 1 and b'"model.safetensors"' in commits[0]["body"], (line, hub.calls[calls:])


def test_the_readme_s_export_line_exports_what_its_pretraining_line_wrote():
    """The README's path connects: its export reads the folder its llama-60m run writes."""
    lines = page_lines(ROOT / "README.md")
    written = {
        command[command.index("--output_dir") + 1]
        for line in lines
        for command in commands(line)
        if script_call(command) and "--output_dir" in command
    }
    exports = [command for line in lines for command in commands(line) if script_call(command) == ("scripts/export", 2)]
    assert exports and all(command[2] in written for command in exports), (written, exports)


def test_the_skip_reasons_see_what_they_are_meant_to():
    """The reasons are not a blanket: each of these runs here, and each of the others is skipped for its reason."""
    runs = ["python scripts/pretrain.py --config_name configs/models/llama-3.1-8b.json", "poet-hf pretrain"]
    assert all(_reason(line) is None for line in runs)
    assert "Hub" in _reason("python scripts/finetune.py --model_name_or_path gpt2 --method oft")
    assert "GPUs" in _reason("accelerate launch --config_file examples/cluster/ddp.yaml scripts/pretrain.py")
    assert _reason("accelerate launch --config_file examples/cluster/cpu_ddp.yaml scripts/pretrain.py") is None


def test_a_line_the_pages_repeat_runs_once():
    """The DDP line of docs/distributed.md and docs/pretraining.md runs on the first page only."""
    repeated = [entry for entry in LINES if "--multi_gpu --num_processes 2 scripts/pretrain.py" in entry[2]]
    places = [_first_place(entry) for entry in repeated]
    assert len(repeated) == 2 and places[0] is None and places[1] == f"docs/distributed.md:{repeated[0][1]}"
