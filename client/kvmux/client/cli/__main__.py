"""``python -m kvmux.client.cli``: the same as the ``kvmux`` command."""

import sys

from .main import main

if __name__ == "__main__":
    sys.exit(main())
