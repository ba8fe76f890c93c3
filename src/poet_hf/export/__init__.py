"""Export a POET / OFT / orthogonal model as a plain Hugging Face checkpoint, write its model card, push it.

[`export_merged`][poet_hf.export.export_merged] loads the source (`source`), folds every PEFT tuner layer into plain
weights through PEFT's own ``merge_and_unload`` in float32 (`folding`), casts to the requested dtype, and writes
``model.safetensors`` (sharded above ``max_shard_size``), ``config.json``, the tokenizer when there is one, and a
``README.md`` model card (`card`) into a temporary directory beside the target that is renamed into place at
the end (`writing`): an interrupted export leaves nothing half-written.
[`push_merged_to_hub`][poet_hf.export.push_merged_to_hub] uploads
such a folder with ``huggingface_hub`` (`hub`). [`export_peft_adapter`][poet_hf.export.export_peft_adapter] writes an
OFT adapter in PEFT's own ``OFTConfig`` format, which stock PEFT loads without this package (`peft_adapter`).
"""

from .card import render_model_card
from .hub import HubPushError, push_merged_to_hub
from .peft_adapter import export_peft_adapter
from .source import ExportError, supported_peft_types
from .writing import export_merged

__all__ = [
    "export_merged",
    "export_peft_adapter",
    "push_merged_to_hub",
    "render_model_card",
    "ExportError",
    "HubPushError",
    "supported_peft_types",
]
