"""Start worker scripts (one process, torchrun-style ranks, or the ranks of an ``accelerate launch``) forked from a
server that has already imported torch, transformers, PEFT and poet_hf.

A fresh interpreter spends about 14 s of CPU on those imports (PEFT's pulls in torch._dynamo and torch._inductor), and
the multi-process tests start dozens of processes. A child forked from the server (multiprocessing's forkserver, which
imports them once and has run nothing else) is a new process with only the imports done: it reads all it resumes from
disk, gets the environment torchrun would give it, and a SIGKILL ends it as it ends any process.
"""

from __future__ import annotations

import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
import time
from pathlib import Path

from training_utils import free_port

# What training_utils and the workers import (the server is started with the interpreter's own sys.path, which does
# not hold tests/, so the packages are named rather than training_utils).
PRELOAD = ["torch", "transformers.trainer", "datasets", "peft", "accelerate", "poet_hf"]


def _context() -> multiprocessing.context.BaseContext:
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    return context


def _run_script(script: str, args: list[str], env: dict[str, str], log: str, cwd: str | None = None) -> None:
    """The child: the environment and working folder, stdout/stderr into ``log``, then ``script`` as ``__main__``
    (``-m name``: the module ``name``, as ``python -m name`` runs it)."""
    os.environ.update(env)
    if cwd is not None:
        os.chdir(cwd)
    with open(log, "ab", buffering=0) as sink, open(os.devnull, "wb") as null:
        os.dup2(null.fileno(), 1)
        os.dup2(sink.fileno(), 2)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    if env.get("PYTHONWARNINGS") == "ignore":
        import warnings

        warnings.simplefilter("ignore")
    if "OMP_NUM_THREADS" in env:
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    sys.argv = [script, *args]
    if script.startswith("-m "):
        runpy.run_module(script.removeprefix("-m "), run_name="__main__", alter_sys=True)
    else:
        runpy.run_path(script, run_name="__main__")


class Ranks:
    """The processes of one launch, watched as torchrun's agent watches them: when one fails the others are killed,
    and the launch's exit code is that first failure's (``-signal`` for a signal)."""

    def __init__(self, processes: list[multiprocessing.process.BaseProcess]):
        self.processes = processes
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            codes = [process.exitcode for process in self.processes]
            failed = [code for code in codes if code not in (None, 0)]
            if failed:
                self.kill()
                self.returncode = failed[0]
            elif all(code == 0 for code in codes):
                self.returncode = 0
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired("prewarmed launch", timeout)
            time.sleep(0.02)
        return self.returncode

    def kill(self) -> None:
        """SIGKILL every rank at once (the whole launch dies, as when a node is lost)."""
        for process in self.processes:
            if process.exitcode is None:
                try:
                    os.kill(process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for process in self.processes:
            process.join()


def start(
    script: str | Path,
    args: list[str],
    log: Path,
    env: dict[str, str] | None = None,
    ranks: int = 1,
    torchrun: bool | None = None,
    cwd: Path | None = None,
) -> Ranks:
    """Start ``script args`` in ``ranks`` processes, in the folder ``cwd`` (default: the server's). ``script`` is a
    file or ``-m module``. With ``torchrun`` (the default for more than one) each gets torchrun's variables (RANK,
    LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), so ``init_process_group`` and accelerate find
    their rendezvous as under ``torchrun --nproc_per_node``."""
    context = _context()
    base = {"OMP_NUM_THREADS": "1", **(env or {})}
    torchrun = ranks > 1 if torchrun is None else torchrun
    if torchrun:
        base |= {"WORLD_SIZE": str(ranks), "LOCAL_WORLD_SIZE": str(ranks), "MASTER_ADDR": "127.0.0.1"}
        base["MASTER_PORT"] = str(free_port())
    processes = []
    for rank in range(ranks):
        rank_env = base | ({"RANK": str(rank), "LOCAL_RANK": str(rank)} if torchrun else {})
        arguments = (str(script), [str(a) for a in args], rank_env, str(log), None if cwd is None else str(cwd))
        process = context.Process(target=_run_script, args=arguments)
        process.start()
        processes.append(process)
    return Ranks(processes)


def run(
    script: str | Path,
    args: list[str],
    log: Path,
    env: dict[str, str] | None = None,
    ranks: int = 1,
    timeout: float = 600,
    torchrun: bool | None = None,
    cwd: Path | None = None,
) -> None:
    """Run a launch (`start`'s arguments) to its end and fail the test, with the log's tail, unless every rank exits 0
    (a hung launch is killed after ``timeout`` seconds)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    launch = start(script, args, log, env=env, ranks=ranks, torchrun=torchrun, cwd=cwd)
    try:
        code = launch.wait(timeout)
    except subprocess.TimeoutExpired:
        launch.kill()
        code = None
    tail = log.read_text()[-3000:] if log.exists() else ""
    assert code == 0, f"{Path(script).name} {' '.join(map(str, args))}: exit code {code}; its log:\n{tail}"


def accelerate_launch(
    launch_args: list, log: Path, env: dict[str, str] | None = None, timeout: float = 600, cwd: Path | None = None
) -> None:
    """``accelerate launch <launch_args>`` (its flags, then the script or ``-m module`` and the script's arguments),
    run to its end in the folder ``cwd`` as `run` runs a launch. accelerate's own ``launch_command`` runs (its parser
    reads the config file and the flags, its launcher prepares the processes' environment) up to where it would start
    torchrun, or the one process of a launch without it; those processes are then forked from the server, with that
    environment, instead of started as fresh interpreters."""
    from unittest import mock

    import accelerate.commands.launch as launch

    before = dict(os.environ)
    seen: dict = {}

    def changed(environment) -> dict[str, str]:
        return {key: value for key, value in environment.items() if before.get(key) != value}

    def torchrun(args) -> None:  # the launcher calls it inside `patch_environment(**the ranks' environment)`
        seen.update(ranks=int(args.nproc_per_node), env=changed(os.environ), torchrun=True)

    def one_process(command, environment, quiet) -> None:
        seen.update(ranks=1, env=changed(environment), torchrun=False)

    args = launch.launch_command_parser().parse_args([str(argument) for argument in launch_args])
    script = f"-m {args.training_script}" if args.module else args.training_script
    with mock.patch.object(launch, "_run_torchrun", torchrun):
        with mock.patch.object(launch, "_run_subprocess", one_process):
            launch.launch_command(args)
    environment = {**seen["env"], **(env or {})}
    run(script, args.training_script_args, log, environment, seen["ranks"], timeout, seen["torchrun"], cwd)
