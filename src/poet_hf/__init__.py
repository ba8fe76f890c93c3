"""poet_hf: orthogonal-equivalence training (POET, OFT, orthogonal layers) for the Hugging Face stack.

Importing this package registers the POET, OFT and orthogonal tuners with stock PEFT, so
``peft.get_peft_model(model, PoetConfig(...))`` and ``PeftModel.from_pretrained`` work unchanged.
"""

from .tuners.registry import register_tuners

register_tuners()

from .export import export_merged, push_merged_to_hub  # noqa: E402
from .training import MergeReinitCallback, PoetTrainer, PoetTrainingArguments  # noqa: E402
from .tuners.oft import OftConfig  # noqa: E402
from .tuners.orthogonal import OrthogonalConfig  # noqa: E402
from .tuners.poet import PoetConfig, merge_and_reinit  # noqa: E402
from .vision import lipconvnet as _lipconvnet  # noqa: E402,F401  (registers LipConvNet with the Auto classes)

__version__ = "0.1.0"
__all__ = ["PoetConfig", "OftConfig", "OrthogonalConfig", "PoetTrainer", "PoetTrainingArguments", "MergeReinitCallback", "merge_and_reinit",
           "export_merged", "push_merged_to_hub"]
