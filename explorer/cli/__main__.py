"""``python -m explorer.cli``: the ``explorer`` command line."""

import sys

from explorer.cli.main import main

sys.exit(main())
