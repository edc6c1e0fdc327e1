"""`python -m engine.native`: build and load the kernels, print the library's path; exit
1 with the reason where they cannot be. The Docker image's build runs it, so an image
without a working compiler or without the C sources fails there."""

from __future__ import annotations

import sys

from engine.native.ops import kernel_status


def main() -> int:
    status = kernel_status()
    if not status.active:
        print(f"native CPU kernels unavailable: {status.reason}", file=sys.stderr)
        return 1
    print(status.library)
    return 0


if __name__ == "__main__":
    sys.exit(main())
