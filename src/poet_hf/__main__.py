"""``python -m poet_hf COMMAND ...`` (and ``accelerate launch -m poet_hf COMMAND ...``): the ``poet-hf`` command."""

import sys

from .recipes.commands import main

if __name__ == "__main__":
    sys.exit(main())
