"""`python -m gpujobs.plan`: the entry point of `gpujobs plan` (the command lives in `gpujobs.cli.plan`)."""

from gpujobs.cli.plan import main

if __name__ == "__main__":
    raise SystemExit(main())
