"""`bound_allocator_slack`: glibc's mmap threshold fixed where the memory savings run. Checked on the C library
itself, in fresh processes: after an 8 MiB block is freed (and the heap trimmed, so that its top cannot serve the
next request), a 4 MiB block is served by its own ``mmap`` (glibc's ``mallinfo2().hblks`` counts those) only when
the threshold is fixed; glibc's dynamic threshold would have risen to 8 MiB and grown the heap instead."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")

PROBE = """
import ctypes, json, sys
from poet_hf.allocator import bound_allocator_slack

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
libc.mallinfo2.restype = MallInfo2
bounded = bound_allocator_slack() if sys.argv[1] == "bound" else False
libc.free(libc.malloc(8 << 20))  # an 8 MiB block, mmapped and freed: the dynamic threshold rises to 8 MiB
libc.malloc_trim(0)
before = libc.mallinfo2().hblks
block = libc.malloc(4 << 20)
print(json.dumps({"bounded": bounded, "mmapped": libc.mallinfo2().hblks - before}))
libc.free(block)
"""


def probe(mode: str, **env: str) -> dict:
    environment = {k: v for k, v in os.environ.items() if k not in ("MALLOC_MMAP_THRESHOLD_", "POET_HF_ALLOCATOR")}
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode], env={**environment, **env}, capture_output=True, text=True, check=True
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_the_fixed_threshold_returns_large_blocks_to_the_system_after_a_larger_one_was_freed():
    assert probe("default") == {"bounded": False, "mmapped": 0}  # glibc's own: served from the heap
    assert probe("bound") == {"bounded": True, "mmapped": 1}  # fixed: its own mmap, unmapped when freed


def test_the_users_allocator_setting_wins():
    assert probe("bound", POET_HF_ALLOCATOR="default") == {"bounded": False, "mmapped": 0}
    assert probe("bound", MALLOC_MMAP_THRESHOLD_="16777216")["bounded"] is False  # theirs, untouched


def test_the_memory_saving_paths_fix_it(tmp_path):
    code = (
        "import torch, json; from poet_hf.training import FusedStepOptimizer; "
        "from poet_hf.allocator import bound_allocator_slack; "
        "FusedStepOptimizer([{'params': [torch.nn.Parameter(torch.zeros(2))]}], torch.optim.AdamW); "
        "print(json.dumps(bound_allocator_slack.cache_info().hits + bound_allocator_slack.cache_info().misses))"
    )
    environment = {k: v for k, v in os.environ.items() if k not in ("MALLOC_MMAP_THRESHOLD_", "POET_HF_ALLOCATOR")}
    out = subprocess.run([sys.executable, "-c", code], env=environment, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == 1  # the optimizer called it


MATERIALIZE = """
import json, sys, torch
from peft import get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM
import poet_hf
from poet_hf import PoetConfig
from poet_hf.allocator import bound_allocator_slack
from poet_hf.initialization import materialize_model
config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4)
with torch.device("meta"):
    model = LlamaForCausalLM(config)
quantization = None if sys.argv[1] == "none" else sys.argv[1]
model = get_peft_model(model, PoetConfig(block_size=32, base_init="normalized", base_quantization=quantization))
materialize_model(model, seed=0, device="cpu")
print(json.dumps(bound_allocator_slack.cache_info().misses))
"""


@pytest.mark.parametrize("quantization, bounded", [("none", 0), ("nf4", 1)])
def test_a_build_bounds_the_allocator_only_where_it_quantises_w0(quantization, bounded):
    """The fixed threshold costs a POET step about 1.5× its time on a CPU, so a plain build on ``meta`` leaves glibc's
    setting alone; a build that quantises each ``W0`` as it goes (the 7B path) fixes it."""
    environment = {k: v for k, v in os.environ.items() if k not in ("MALLOC_MMAP_THRESHOLD_", "POET_HF_ALLOCATOR")}
    out = subprocess.run(
        [sys.executable, "-c", MATERIALIZE, quantization], env=environment, capture_output=True, text=True, check=True
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == bounded
