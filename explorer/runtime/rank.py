"""Entry point of one training rank: ``python -m explorer.runtime.rank JOB_DIR [--steps N]``.

Started by ``ex.run`` (or by ``torchrun`` through an exported script) with RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT set; see :mod:`explorer.runtime.worker`.
"""

import sys

from explorer.runtime.worker import main

if __name__ == "__main__":
    sys.exit(main())
