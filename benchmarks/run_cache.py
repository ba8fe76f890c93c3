"""Quality runs in parallel, each finished one kept: what the fine-tuning and pretraining quality suites share.

A quality run's losses and peak memory do not depend on what else runs on the machine (its time per step does, so
no suite reads time from these runs). `run_parallel` runs each job in its own process, ``workers`` at a time with one
torch thread each, and keeps every finished record under ``.cache/<name>/``, keyed by the job's arguments and a hash
of the code it executes (`code_version`), so that a suite cut off part-way resumes where it stopped.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
Child = Callable[[list[str], Path], dict[str, Any]]


def code_version(files: Iterable[Path]) -> str:
    """A hash of the package (every ``src/poet_hf`` module) and ``files``: the code a run executes."""
    digest = hashlib.sha256()
    for path in [*sorted((ROOT / "src" / "poet_hf").rglob("*.py")), *files]:
        digest.update(str(path.relative_to(ROOT)).encode() + path.read_bytes())
    return digest.hexdigest()[:16]


def run_parallel(
    jobs: dict[Any, Callable[[], list[str]]], child: Child, cache: Path, version: str, workers: int = 2
) -> dict[Any, dict[str, Any]]:
    """Run each job through ``child`` (its arguments and a scratch folder → its record), ``workers`` at a time.

    Args:
        jobs: a key → a function giving the job's arguments, called when a worker takes it (so a job whose model is
            still being built waits alone).
        child: runs one job in its own process, with one torch thread, and returns its record.
        cache: the folder that keeps each finished record, keyed by its arguments and ``version``.
        version: `code_version` of what the jobs execute: a change to that code runs them again.
        workers: how many jobs run at a time.
    """
    import tempfile
    from concurrent.futures import ThreadPoolExecutor

    def cached_run(argv: list[str], scratch: Path) -> dict[str, Any]:
        key = hashlib.sha256(json.dumps([version, argv]).encode()).hexdigest()[:24]
        path = cache / f"{key}.json"
        if path.exists():
            return json.loads(path.read_text())
        record = child(argv, scratch)
        cache.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record))
        return record

    with tempfile.TemporaryDirectory() as scratch, ThreadPoolExecutor(workers) as pool:
        futures = {
            key: pool.submit(lambda argv, index: cached_run(argv(), Path(scratch) / str(index)), argv, index)
            for index, (key, argv) in enumerate(jobs.items())
        }
        return {key: future.result() for key, future in futures.items()}
