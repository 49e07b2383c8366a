"""``python -m explorer.cli``: the ``explorer`` command line."""

import sys

from explorer.cli.commands import main

sys.exit(main())
