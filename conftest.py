"""The Python blocks of README.md and docs/ run as tests (pytest-markdown-docs, superfences syntax). Each block runs
in a fresh temporary folder, so what it saves (an adapter, an export) never lands in the repository."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _markdown_block_in_a_temporary_folder(request, tmp_path, monkeypatch):
    if type(request.node).__module__.startswith("pytest_markdown_docs"):
        monkeypatch.chdir(tmp_path)
        torch.manual_seed(0)
