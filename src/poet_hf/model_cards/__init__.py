"""The model-card templates shipped with poet_hf, and the one function that renders them."""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from huggingface_hub import ModelCard

TEMPLATES = ("poet.md", "lipconvnet.md", "adapter.md")


def template_path(name: str) -> Path:
    """The packaged template ``name`` (one of `TEMPLATES`)."""
    if name not in TEMPLATES:
        raise ValueError(f"model card template must be one of {TEMPLATES}, got {name!r}")
    return Path(str(resources.files(__name__) / name))


def render_card(template: str, card_data: dict[str, Any], **variables: Any) -> ModelCard:
    """A ``huggingface_hub.ModelCard`` from the packaged ``template``.

    ``card_data`` becomes the YAML metadata (``library_name`` is ``transformers`` unless it says otherwise);
    ``variables`` fill the Jinja template."""
    from huggingface_hub import ModelCard, ModelCardData

    data = ModelCardData(**{"library_name": "transformers", **card_data})
    return ModelCard.from_template(data, template_path=str(template_path(template)), **variables)
