"""Wall time of importing poet_hf, and of a training script's ``--help``, each a whole new process.

``import poet_hf`` loads nothing heavy: its public names load on first use, and its tuners register with PEFT once
PEFT is imported. What a user of POET through PEFT pays is ``import poet_hf, peft``; the baseline is ``import peft``
as it costs without poet_hf, which imports bitsandbytes where it is installed (poet_hf's hook keeps it out).
``scripts/pretrain.py --help`` builds its parser over ``TrainingArguments``, whose module imports PEFT and with it
transformers' model code: ``import poet_hf, transformers.training_args`` is what its parser imports. Each import row
names the optional backends (bitsandbytes, torchao, DeepSpeed, kernels) the process ended up importing. The commands
alternate so that drift on a shared machine hits all alike; the median of the repeats is reported.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BACKENDS = ("bitsandbytes", "torchao", "deepspeed", "kernels")
_REPORT = f"import json, sys; print(json.dumps(sorted(m for m in {BACKENDS!r} if m in sys.modules)))"
BASELINE = "import peft"
PARSER_IMPORTS = "import poet_hf, transformers.training_args"  # what a training script's parser imports
COMMANDS: dict[str, list[str]] = {
    BASELINE: ["-c", "import peft"],
    "import poet_hf": ["-c", "import poet_hf"],
    "import poet_hf, peft": ["-c", "import poet_hf, peft"],
    PARSER_IMPORTS: ["-c", PARSER_IMPORTS],
    "scripts/pretrain.py --help": [str(ROOT / "scripts" / "pretrain.py"), "--help"],
}


def process_seconds(arguments: list[str]) -> float:
    """Seconds a new interpreter takes to run ``arguments`` to its exit, start-up included."""
    start = time.perf_counter()
    subprocess.run([sys.executable, *arguments], capture_output=True, check=True, cwd=ROOT)
    return time.perf_counter() - start


def backends_imported(code: str) -> list[str]:
    """The optional backends in ``sys.modules`` after running ``code`` in a new interpreter."""
    done = subprocess.run(
        [sys.executable, "-c", f"{code}\n{_REPORT}"], capture_output=True, text=True, check=True, cwd=ROOT
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(quick: bool = False) -> list[dict]:
    repeats = 2 if quick else 7
    times: dict[str, list[float]] = {name: [] for name in COMMANDS}
    for _ in range(repeats):
        for name, arguments in COMMANDS.items():
            times[name].append(process_seconds(arguments))
    seconds = {name: statistics.median(values) for name, values in times.items()}
    rows: list[dict] = []
    for name, arguments in COMMANDS.items():
        row: dict = {"command": name, "repeats": repeats, "seconds": seconds[name]}
        row["/ import peft"] = seconds[name] / seconds[BASELINE]
        if arguments[0] == "-c":
            row["backends imported"] = backends_imported(arguments[1])
        rows.append(row)
    return rows
