"""``python -m fxsplit``: the same command line as the ``fxsplit`` entry point (see fxsplit.cli)."""

import sys

from fxsplit.cli import main

sys.exit(main())
