"""``python -m rtkernels``: the ``rtkernels`` command line (see :mod:`rtkernels.cli`)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
