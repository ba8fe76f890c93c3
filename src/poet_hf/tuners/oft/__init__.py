"""OFT: orthogonal fine-tuning ``W0 · R^T``, the one-sided POET, sharing POET's core (PEFT tuner ``"poet_oft"``)."""

from .config import OftConfig
from .layer import Conv1D, Conv2d, Linear, OftLayer
from .model import OftModel
from .peft_compat import our_oft_state_dict_to_peft, peft_oft_state_dict_to_ours

__all__ = [
    "OftConfig",
    "OftModel",
    "OftLayer",
    "Linear",
    "Conv1D",
    "Conv2d",
    "peft_oft_state_dict_to_ours",
    "our_oft_state_dict_to_peft",
]
