"""`python -m minisgl`: the OpenAI-compatible server, or `--shell` for a terminal chat."""

from __future__ import annotations

from minisgl.server.launch import main

if __name__ == "__main__":
    main()
