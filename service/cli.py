"""snca-serve: placeholder until the service issue lands."""

import sys


def main(argv: list[str] | None = None) -> int:
    print("snca-serve: not implemented yet (the service is a later issue)", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
