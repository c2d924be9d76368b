"""`python -m gpujobs.submit`: kept as an entry point; the command lives in `gpujobs.cli.submit`."""

from gpujobs.cli.submit import main

if __name__ == "__main__":
    main()
