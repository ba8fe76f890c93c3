"""Small helpers around PEFT's wrappers."""

from __future__ import annotations

from typing import Any

from torch import nn


def base_model_of(model: nn.Module) -> Any:
    """The model under PEFT: ``model.get_base_model()`` for a ``PeftModel``, else ``model`` itself.

    Typed as ``Any``: usually a ``transformers`` model (``get_input_embeddings``, ``config``…), but any module works.
    """
    get_base_model = getattr(model, "get_base_model", None)
    return model if get_base_model is None else get_base_model()
