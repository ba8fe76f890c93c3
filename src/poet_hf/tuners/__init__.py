"""PEFT tuners: one folder per method, each in PEFT's config/layer/model shape.

`poet` and `oft` are thin siblings over the rotation family (`rotation`); `orthogonal_layers` makes weights
orthogonal in place. Importing this package registers the three with PEFT (`registry`).
"""

from .registry import register_tuners

register_tuners()
