"""`python -m minisgl.bench {offline,serve,stress} ...`"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = ("offline", "serve", "stress")
    if not argv or argv[0] not in commands:
        print(f"usage: python -m minisgl.bench {{{','.join(commands)}}} [options]  (--help for each)", file=sys.stderr)
        return 2
    command, rest = argv[0], argv[1:]
    if command == "offline":
        from minisgl.bench.offline import main as run
    elif command == "serve":
        from minisgl.bench.serve import main as run  # type: ignore[no-redef]
    else:
        from minisgl.bench.stress import main as run  # type: ignore[no-redef]
    return run(rest)


if __name__ == "__main__":
    sys.exit(main())
