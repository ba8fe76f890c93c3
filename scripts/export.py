#!/usr/bin/env python
"""Export a POET / OFT model as a plain Hugging Face checkpoint, and optionally push it to the Hub.

    python scripts/export.py SOURCE OUTPUT_DIR [--push_to_hub --hub_model_id REPO_ID] [--hub_private_repo]
                             [--hub_token TOKEN] [--dtype bf16|fp16|fp32] [--overwrite]

The same command as ``poet-hf export`` (`poet_hf.recipes.export_command`, which says what each flag does).
Exit codes: 0 success; 1 export refused; 2 usage error or no Hub token (checked before exporting);
3 export written, but the push failed (the export stays complete on disk).
"""

import sys

from poet_hf.recipes.export_command import build_parser, main

__all__ = ["build_parser", "main"]

if __name__ == "__main__":
    sys.exit(main())
