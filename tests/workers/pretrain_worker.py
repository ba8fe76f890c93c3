"""``scripts/pretrain.py`` as a user runs it, for the tests that kill a pretraining run.

Usage: pretrain_worker.py [--die_before_results] ARGS... With ``--die_before_results`` the process SIGKILLs itself
where the run would write its results (after training, its last checkpoint and the final evaluation), as a job killed
between its last save and its ``results.json`` dies; ARGS go to the script unchanged.
"""

import os
import runpy
import signal
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "pretrain.py"


def main() -> None:
    args = sys.argv[1:]
    if args[:1] == ["--die_before_results"]:
        import poet_hf.recipes.pretrain as pretrain

        def die(*_: object, **__: object) -> None:
            os.kill(os.getpid(), signal.SIGKILL)

        pretrain._save_and_export = die
        args = args[1:]
    sys.argv = [str(SCRIPT), *args]
    runpy.run_path(str(SCRIPT), run_name="__main__")


if __name__ == "__main__":
    main()
