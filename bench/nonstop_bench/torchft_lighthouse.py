"""torchft's Lighthouse, started from a file: it reads its options from the process's arguments
after the interpreter's (``python torchft_lighthouse.py --bind ...``), so it cannot be started
with ``python -c``. Used by ``torchft_run.py``."""

import sys

from torchft._torchft import lighthouse_main

if __name__ == "__main__":
    sys.exit(lighthouse_main())
