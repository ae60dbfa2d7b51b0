"""``python -m revlib_xla.demo``: see :mod:`revlib_xla.demo`."""

import sys

from . import main

sys.exit(main())
