"""``python -m trainmon``: the same as the ``trainmon`` command."""

import sys

from trainmon.tools.cli import main

sys.exit(main())
