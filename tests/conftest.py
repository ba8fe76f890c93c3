import os
import sys
from pathlib import Path

# The tests' helpers (reference implementations, tiny models, tolerances, servers) live in tests/helpers/, the scripts
# the multi-process tests launch in tests/workers/.
sys.path.insert(0, str(Path(__file__).resolve().parent / "helpers"))

import pytest  # noqa: E402
import tolerance_audit  # noqa: E402
import torch  # noqa: E402
from tolerance_audit import pytest_assertion_pass  # noqa: E402, F401  (records figures when POET_TOLERANCE_AUDIT is set)

# The tests use tiny models: one thread avoids OpenMP spin-waits, which on 2 cores cost more than they give.
# POET_TEST_THREADS runs the suite with more, to check that no tolerance depends on the reduction order.
torch.set_num_threads(int(os.environ.get("POET_TEST_THREADS", "1")))

_current_test = {"id": None}
if tolerance_audit.audit_file():
    tolerance_audit.install(lambda: _current_test["id"])


@pytest.fixture(autouse=True)
def _seed(request):
    _current_test["id"] = request.node.nodeid
    torch.manual_seed(0)


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config, items):
    """The tests on the pretrained testbed run first, all on one xdist worker (group "testbed"): the first builds the
    testbed (about 5½ minutes of one core on a clean clone) while the other worker runs the rest of the suite. Then
    the other long units (the xdist groups and the tests marked ``slow``), then the short tests: xdist hands out its
    units in this order, so the short ones fill the end of the run instead of one worker idling while the other
    finishes a long one."""
    for item in items:
        if item.get_closest_marker("testbed") is not None:
            item.add_marker(pytest.mark.xdist_group("testbed"))

    def long_first(item) -> int:
        if item.get_closest_marker("testbed") is not None:
            return 0
        long = item.get_closest_marker("xdist_group") or item.get_closest_marker("slow")
        return 1 if long else 2

    items.sort(key=long_first)


@pytest.hookimpl(trylast=True)  # after xdist's worker hook has suffixed each grouped test's id with "@group"
def pytest_collection_finish(session):
    """Refuses a run whose xdist groups were silently dropped: the suite's expensive shared fixtures (the testbed, the
    multi-process runs) would be built on both workers, or one worker would wait out the other's build."""
    if not getattr(session.config.option, "loadgroup", False):  # the controller, or a run without xdist
        return
    lost = [item.nodeid for item in session.items if item.get_closest_marker("xdist_group") and "@" not in item.nodeid]
    if lost:
        message = (
            f"--dist loadgroup ignored the xdist_group of {len(lost)} test(s) ({lost[0]}, ...): this pytest and "
            "pytest-xdist do not group (pytest-dev/pytest-xdist#1386); install the versions pyproject.toml's [dev] pins"
        )
        # A worker's exception reaches the user only as xdist's INTERNALERROR about a crashed test: say it first.
        print(f"\nERROR: {message}", file=sys.__stderr__, flush=True)
        raise pytest.UsageError(message)


@pytest.fixture(scope="session")
def tiny_pretraining(tmp_path_factory):
    """The README's main job, shortened to 30 steps with a merge every 7 (4 merges) and 32 validation sequences: the
    report of ``run_pretraining`` for a given ``base_quantization``, each run once per worker (the tests that share
    them are in the xdist group "tiny_pretraining")."""
    from poet_hf.recipes.pretrain import parse_pretrain_arguments, run_pretraining

    reports: dict = {}

    def report(base_quantization: str | None = None) -> dict:
        if base_quantization not in reports:
            output_dir = tmp_path_factory.mktemp(f"pretraining-{base_quantization}")
            arguments = parse_pretrain_arguments(
                output_dir=str(output_dir),
                max_steps=30,
                merge_every=7,
                max_eval_samples=32,
                base_quantization=base_quantization,
            )
            reports[base_quantization] = run_pretraining(*arguments)
        return reports[base_quantization]

    return report


@pytest.fixture(scope="session")
def stock_python():
    """Runs snippets in new processes that never import poet_hf (tests/helpers/stock_python.py)."""
    from stock_python import StockPython

    python = StockPython()
    yield python
    python.close()


@pytest.fixture(scope="session")
def testbed():
    """The pretrained causal LM of the testbed and its fine-tuning domain (tests/helpers/testbed_runs.py)."""
    from testbed_runs import testbed_model_and_corpus

    return testbed_model_and_corpus()


@pytest.fixture(scope="session")
def local_corpus(tmp_path_factory):
    """A small local .jsonl corpus (20 passages of the embedded plays): the local-file path users take."""
    import json

    from poet_hf.data import load_embedded_corpus

    path = tmp_path_factory.mktemp("corpus") / "passages.jsonl"
    texts = [play["text"][i * 3000 : (i + 1) * 3000] for play in load_embedded_corpus()["train"] for i in range(2)]
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[:20]))
    return str(path)
