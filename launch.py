"""radixmux launcher (the serving runtime is not built yet)."""

import sys


def main() -> int:
    print("radixmux: the HTTP server is coming; set-up succeeded.", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
