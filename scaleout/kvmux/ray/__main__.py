"""``python -m kvmux.ray``: the ``kvmux-ray`` command."""

import sys

from .cli import main

sys.exit(main())
