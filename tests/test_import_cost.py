"""What ``import poet_hf`` costs: no optional backend, no output, no request to the Hub; and its tuners register with
PEFT whoever imports PEFT afterwards, without PEFT importing bitsandbytes on the way.

Each check runs in a new interpreter (the test process has imported everything already), with ``HF_ENDPOINT`` at a
stand-in Hub that records every request: on a CPU with AVX-512 BF16, importing bitsandbytes asks the Hub about a
kernel publisher.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hub_stand_in import StandInHub

BACKENDS = ("bitsandbytes", "torchao", "deepspeed", "kernels")
# The check, verbatim: it must print [] and nothing else.
IMPORT_CHECK = (
    "import sys, poet_hf; print(sorted(m for m in ('bitsandbytes', 'torchao', 'deepspeed', 'kernels') "
    "if m in sys.modules))"
)


def run_python(code: str, tmp_path: Path, endpoint: str, offline: bool = False) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update({"HF_ENDPOINT": endpoint, "HF_HOME": str(tmp_path / "hf_home"), "OMP_NUM_THREADS": "1"})
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("offline", [False, True], ids=["online", "HF_HUB_OFFLINE"])
def test_import_poet_hf_loads_no_optional_backend_prints_nothing_and_asks_no_hub(tmp_path, offline):
    with StandInHub() as hub:
        done = run_python(IMPORT_CHECK, tmp_path, hub.url, offline)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (done.stdout, done.stderr) == ("[]\n", "")
    assert hub.calls == []


def test_import_poet_hf_leaves_peft_and_the_model_code_for_first_use(tmp_path):
    code = "import sys, poet_hf; print(sorted(m for m in ('peft', 'transformers.modeling_utils') if m in sys.modules))"
    with StandInHub() as hub:
        done = run_python(code, tmp_path, hub.url)
    assert (done.returncode, done.stdout, done.stderr) == (0, "[]\n", "")


PEFT_AFTER_POET_HF = """
import importlib.util, json, sys
import poet_hf
import peft
from peft.import_utils import is_bnb_available
from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING
state = {
    "registered": sorted(t for t in ("POET", "POET_OFT", "ORTHOGONAL") if t in PEFT_TYPE_TO_CONFIG_MAPPING),
    "bitsandbytes_imported": "bitsandbytes" in sys.modules,
    "bitsandbytes_available_to_peft": is_bnb_available(),
    "hooks_left": [type(f).__name__ for f in sys.meta_path if type(f).__module__.startswith("poet_hf")],
}
print(json.dumps(state), flush=True)
if importlib.util.find_spec("bitsandbytes") is not None:  # and it loads as usual once a feature asks for it
    import huggingface_hub.constants
    huggingface_hub.constants.HF_HUB_OFFLINE = True  # its kernel lookup may not reach the stand-in: nothing before did
    import bitsandbytes.functional
    print(callable(bitsandbytes.functional.quantize_4bit))
"""


def test_peft_imported_after_poet_hf_has_the_tuners_and_does_not_import_bitsandbytes(tmp_path):
    with StandInHub() as hub:
        done = run_python(PEFT_AFTER_POET_HF, tmp_path, hub.url)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    state = json.loads(next(line for line in lines if line.startswith("{")))
    installed = importlib.util.find_spec("bitsandbytes") is not None
    assert state["registered"] == ["ORTHOGONAL", "POET", "POET_OFT"]
    assert state["bitsandbytes_imported"] is False
    assert state["bitsandbytes_available_to_peft"] is installed  # PEFT's own check still finds it
    assert state["hooks_left"] == []  # the one-shot hook left sys.meta_path once PEFT loaded
    assert hub.calls == []
    if installed:  # bitsandbytes imported afterwards works
        assert lines[-1] == "True"


def test_importing_peft_first_registers_the_tuners_when_poet_hf_is_imported(tmp_path):
    code = (
        "import peft, poet_hf, sys\nfrom peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING\n"
        "print('POET' in PEFT_TYPE_TO_CONFIG_MAPPING, any(type(f).__module__.startswith('poet_hf') "
        "for f in sys.meta_path))"
    )
    with StandInHub() as hub:
        done = run_python(code, tmp_path, hub.url, offline=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[-1] == "True False"


@pytest.mark.parametrize("package", ["poet_hf", "poet_hf.training"])
def test_the_type_checkers_see_every_lazy_name_where_it_loads_from(package):
    """A package with lazy names lists each twice: in ``_LAZY_EXPORTS`` (where ``__getattr__`` loads it from) and
    under ``TYPE_CHECKING`` (what mypy and editors see); the two must agree, and every name must load."""
    import ast
    import importlib

    module = importlib.import_module(package)
    tree = ast.parse(Path(module.__file__).read_text())
    block = next(n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING")
    seen = {alias.name: f"{package}.{node.module}" for node in block.body for alias in node.names}
    assert seen == module._LAZY_EXPORTS
    assert sorted(module.__all__) == sorted(seen) and set(seen) <= set(dir(module))
    assert all(getattr(module, name).__name__ == name for name in seen)
