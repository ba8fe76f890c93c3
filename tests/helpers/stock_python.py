"""A Python that never imports poet_hf, for the checks that a plain checkpoint loads in stock transformers.

One server per test worker imports torch and transformers once (about 10 s of CPU a fresh interpreter would pay per
check), then runs each snippet in a child it forks: a new process, with nothing of poet_hf or PEFT in it, its stdout
and stderr captured. The conftest fixture ``stock_python`` hands out the server.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
from pathlib import Path

SERVER = r"""
import json, os, sys, traceback
import torch, transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageClassification
for line in sys.stdin:
    request = json.loads(line)
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            os.chdir(request["cwd"])
            for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
                os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
            sys.argv = ["-c", *request["argv"]]
            exec(compile(request["code"], "<snippet>", "exec"), {"__name__": "__main__"})
        except SystemExit as exit:
            code = exit.code if isinstance(exit.code, int) else 1
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}), flush=True)
"""


class StockPython:
    """``run(code, *argv, cwd=...)`` runs ``code`` as ``python -c code argv...`` would, in a process without poet_hf."""

    def __init__(self) -> None:
        # One thread, and the Hub offline: a stock load must find everything in the folder it is given.
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
        self.server = subprocess.Popen(
            [sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
        )

    def run(self, code: str, *argv: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
        stdout, stderr = cwd / "stock-python.out", cwd / "stock-python.err"
        request = {"code": code, "argv": list(argv), "cwd": str(cwd), "stdout": str(stdout), "stderr": str(stderr)}
        self.server.stdin.write(json.dumps(request) + "\n")
        self.server.stdin.flush()
        ready, _, _ = select.select([self.server.stdout], [], [], timeout)
        if not ready:
            self.close()
            raise subprocess.TimeoutExpired(["stock python", code], timeout)
        reply = self.server.stdout.readline()
        assert reply, "the stock Python server exited"
        returncode = json.loads(reply)["returncode"]
        return subprocess.CompletedProcess(argv, returncode, stdout.read_text(), stderr.read_text())

    def close(self) -> None:
        self.server.kill()
        self.server.wait()
