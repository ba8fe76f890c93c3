"""The release of poet_hf (pyproject.toml holds the same)."""

__version__ = "0.1.0"
