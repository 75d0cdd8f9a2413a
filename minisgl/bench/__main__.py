"""`python -m minisgl.bench {offline,serve,stress,profile,spec,table,dequant-gguf} ...`"""

from __future__ import annotations

import importlib
import sys

# command -> module with `main(argv) -> int`, imported only when chosen
COMMANDS = {
    "offline": "minisgl.bench.offline",  # offline throughput of a random workload
    "serve": "minisgl.bench.serve",  # a serving benchmark against a running server
    "stress": "minisgl.bench.stress",  # hostile and concurrent load against a server
    "profile": "minisgl.bench.profile",  # where the offline workload's time goes
    "spec": "minisgl.bench.spec",  # speculative decoding: single-stream speed-up, verify-step cost
    "table": "minisgl.bench.table",  # markdown table of `serve --json` results
    "dequant-gguf": "minisgl.bench.dequant_gguf",  # an all-F32 GGUF for the llama.cpp peer
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: python -m minisgl.bench {{{','.join(COMMANDS)}}} [options]  (--help for each)", file=sys.stderr)
        return 2
    run = importlib.import_module(COMMANDS[argv[0]]).main
    return int(run(argv[1:]))


if __name__ == "__main__":
    sys.exit(main())
