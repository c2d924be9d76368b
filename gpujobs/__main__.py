"""`python -m gpujobs`: kept as an entry point; the command lives in `gpujobs.cli.manage`."""

import sys

from gpujobs.cli.manage import main

if __name__ == "__main__":
    sys.exit(main())
