"""poet_hf: orthogonal-equivalence training (POET, OFT, orthogonal layers) for the Hugging Face stack.

Importing this package registers the POET, OFT and orthogonal tuners with stock PEFT.
"""

__version__ = "0.1.0"
