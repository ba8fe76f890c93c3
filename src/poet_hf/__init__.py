"""poet_hf: orthogonal-equivalence training (POET, OFT, orthogonal layers) for the Hugging Face stack.

Importing this package registers the POET, OFT and orthogonal tuners with stock PEFT, so
``peft.get_peft_model(model, PoetConfig(...))`` and ``PeftModel.from_pretrained`` work unchanged.
"""

from .tuners.registry import register_tuners

register_tuners()

from .training import MergeReinitCallback, PoetTrainer, PoetTrainingArguments  # noqa: E402
from .tuners.poet import PoetConfig, merge_and_reinit  # noqa: E402

__version__ = "0.1.0"
__all__ = ["PoetConfig", "PoetTrainer", "PoetTrainingArguments", "MergeReinitCallback", "merge_and_reinit"]
