"""snca-build-index: placeholder until the index-builder issue lands."""

import sys


def main(argv: list[str] | None = None) -> int:
    print(
        "snca-build-index: not implemented yet (the index builder is the next issue)",
        file=sys.stderr,
    )
    return 1


if __name__ == "__main__":
    sys.exit(main())
