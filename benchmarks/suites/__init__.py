"""The benchmark suites: each module is one suite (``run(quick) -> list[dict]``), found by `scripts/benchmark.py`."""
