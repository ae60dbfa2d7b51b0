"""``python -m revlib_xla.cli``: the ``revlib-xla`` command without its console script."""

import sys

from . import main

sys.exit(main())
