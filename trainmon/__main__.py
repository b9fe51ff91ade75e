"""``python -m trainmon``: the same as the ``trainmon`` command."""

import sys

from trainmon.cli import main

sys.exit(main())
