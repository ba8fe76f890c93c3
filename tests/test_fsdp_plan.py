"""`--suite fsdp_plan`: each planned row is the launch it names, and its parts add up to its total."""

from __future__ import annotations

import math

from benchmarks.suites import fsdp_plan


def test_the_preset_plans_eight_processes_reaching_the_papers_global_batch() -> None:
    rows = fsdp_plan.run(quick=True)
    assert [row["method"] for row in rows] == list(fsdp_plan.METHODS)
    for row in rows:
        assert row["accumulation"] == 512 // (1 * fsdp_plan.PROCESSES)  # appendix E's 512 sequences, micro-batch 1
        parts = sum(value for key, value in row.items() if key.endswith(" MiB") and key != "total MiB")
        assert math.isclose(parts, row["total MiB"], rel_tol=1e-9)
    by_method = {row["method"]: row for row in rows}
    assert by_method["adamw"]["W0 MiB"] == 0 and by_method["poet-bs"]["W0 MiB"] > 0  # AdamW trains W itself
    # cache_rotations="auto": at 4096 tokens the polynomial is ~5 % of a POET-BS layer's work and each cache would be
    # 8·b/(b−1) times its sharded state, so no layer caches, and POET-BS plans under ¾ of AdamW (issue 68)
    assert by_method["poet-bs"]["rotation caches MiB"] == 0 and by_method["poet-fs"]["rotation caches MiB"] == 0
    assert by_method["poet-bs"]["total MiB"] <= 0.75 * by_method["adamw"]["total MiB"]
    assert by_method["poet-fs"]["total MiB"] <= by_method["adamw"]["total MiB"]
