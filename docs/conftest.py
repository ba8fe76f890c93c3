"""The Python blocks of the documentation run as tests (pytest-markdown-docs, superfences syntax): each block in a
fresh temporary working directory, so what a block saves never lands in the repository."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
