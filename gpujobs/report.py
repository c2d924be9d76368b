"""`python -m gpujobs.report`: kept as an entry point; the command lives in `gpujobs.cli.report`."""

import sys

from gpujobs.cli.report import main

if __name__ == "__main__":
    sys.exit(main())
