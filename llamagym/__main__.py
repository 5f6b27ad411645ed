"""`python -m llamagym doctor` / `python -m llamagym models`: the same as the `llamagym` console script."""

from llamagym.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
