"""Export a POET / OFT / orthogonal model as a plain Hugging Face checkpoint, write its model card, push it.

:func:`export_merged` loads the source (:mod:`.source`), folds every PEFT tuner layer into plain weights through
PEFT's own ``merge_and_unload`` in float32 (:mod:`.folding`), casts to the requested dtype, and writes
``model.safetensors`` (sharded above ``max_shard_size``), ``config.json``, the tokenizer when there is one, and a
``README.md`` model card (:mod:`.card`) into a temporary directory beside the target that is renamed into place at
the end (:mod:`.writing`): an interrupted export leaves nothing half-written. :func:`push_merged_to_hub` uploads
such a folder with ``huggingface_hub`` (:mod:`.hub`).
"""

from .card import render_model_card
from .hub import HubPushError, push_merged_to_hub
from .source import ExportError, supported_peft_types
from .writing import export_merged

__all__ = ["export_merged", "push_merged_to_hub", "render_model_card", "ExportError", "HubPushError",
           "supported_peft_types"]
