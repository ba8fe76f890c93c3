"""The quality suites' runner (`benchmarks.run_cache`): a finished run is kept and not run again, unless the code it
executes changed, so that a suite cut off part-way resumes where it stopped."""

from __future__ import annotations

from pathlib import Path

from benchmarks.run_cache import ROOT, code_version, run_parallel


def test_an_interrupted_suite_resumes_from_the_runs_it_finished(tmp_path: Path) -> None:
    calls = []

    def child(argv: list[str], scratch: Path) -> dict:
        calls.append(argv)
        return {"a": argv}

    first = run_parallel({"x": lambda: ["--seed", "0"], "y": lambda: ["--seed", "1"]}, child, tmp_path, "v1", 1)
    again = run_parallel({"x": lambda: ["--seed", "0"], "z": lambda: ["--seed", "2"]}, child, tmp_path, "v1", 2)
    assert calls == [["--seed", "0"], ["--seed", "1"], ["--seed", "2"]]  # "x" ran once, from the cache the second time
    assert again["x"] == first["x"] == {"a": ["--seed", "0"]}
    run_parallel({"x": lambda: ["--seed", "0"]}, child, tmp_path, "v2", 1)
    assert calls[-1] == ["--seed", "0"] and len(calls) == 4  # a change of the code runs it again


def test_the_code_version_changes_with_a_file_it_covers() -> None:
    probe = ROOT / ".cache" / "run_cache_probe.py"  # under the repository: versions name files relative to it
    probe.parent.mkdir(exist_ok=True)
    try:
        probe.write_text("rate = 1e-3\n")
        before = code_version([probe])
        probe.write_text("rate = 2e-3\n")
        assert code_version([probe]) != before
        assert code_version([]) not in (before, code_version([probe]))
    finally:
        probe.unlink()
