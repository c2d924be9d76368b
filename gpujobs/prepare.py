"""`python -m gpujobs.prepare`: kept as an entry point; the command lives in `gpujobs.cli.prepare`."""

from gpujobs.cli.prepare import main

if __name__ == "__main__":
    raise SystemExit(main())
