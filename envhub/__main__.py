"""``python -m envhub``: the same as the ``envhub`` command."""

import sys

from envhub.cli import main

sys.exit(main())
