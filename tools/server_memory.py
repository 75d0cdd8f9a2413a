"""Where a running server's memory is: each process of a session (or the given pids), RSS and PSS
from /proc/PID/smaps_rollup, and RSS / PSS by mapping from /proc/PID/smaps grouped into kinds
(torch's libraries, other shared libraries, the weights file, anonymous heap, the KV pool's large
anonymous mapping, python, stacks). Findings: docs/performance.md, "Server memory at W2, sixteenth
session (h-rss)".

    python tools/server_memory.py --session PID      # every process of PID's session (setsid)
    python tools/server_memory.py PID [PID...]
    python tools/server_memory.py --session PID --top 15   # also the 15 largest mappings each

Reads only /proc; imports nothing from minisgl.
"""

from __future__ import annotations

import argparse
import os
import re
from collections import defaultdict
from pathlib import Path

_HEADER = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) (\S+) \S+ \S+ \d+\s*(.*)$")


def session_pids(sid: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid:  # field 6 of stat: the session id
            pids.append(int(entry.name))
    return sorted(pids)


def kind_of(name: str, size_kb: int) -> str:
    if not name:
        return "anon (>=256 MiB mapping: KV pool)" if size_kb >= 256 << 10 else "anon"
    if name == "[heap]":
        return "heap (brk)"
    if name.startswith("[stack"):
        return "stacks"
    if name.startswith("["):
        return "other [" + name.strip("[]").split(":")[0] + "]"
    if name.endswith(".gguf") or name.endswith(".safetensors"):
        return "weights file"
    if "/torch/" in name or "/torch.libs/" in name:
        return "torch libs"
    if "/minisgl" in name and name.endswith(".so"):
        return "minisgl C++ libs"
    if "python3" in name or "/lib-dynload/" in name or name.endswith(".pyc"):
        return "python"
    if ".so" in name:
        return "other .so"
    if name.startswith("/dev/shm") or name.startswith("/memfd") or "(deleted)" in name:
        return "shm/memfd"
    return "other files"


def read_smaps(pid: int) -> list[tuple[str, int, int, int]]:
    """(name, size, rss, pss) in KiB per mapping."""
    out: list[tuple[str, int, int, int]] = []
    name, size, rss, pss = "", 0, 0, 0
    started = False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        match = _HEADER.match(line)
        if match:
            if started:
                out.append((name, size, rss, pss))
            name, size, rss, pss, started = match.group(4).strip(), 0, 0, 0, True
            continue
        key, _, value = line.partition(":")
        if key == "Size":
            size = int(value.split()[0])
        elif key == "Rss":
            rss = int(value.split()[0])
        elif key == "Pss":
            pss = int(value.split()[0])
    if started:
        out.append((name, size, rss, pss))
    return out


def rollup(pid: int) -> dict[str, int]:
    values = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, _, value = line.partition(":")
        values[key] = int(value.split()[0])
    return values


def describe(pid: int, top: int) -> tuple[int, int]:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        maps = read_smaps(pid)
        roll = rollup(pid)
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError as exc:
        print(f"pid {pid}: {exc}")
        return 0, 0
    threads = re.search(r"^Threads:\s+(\d+)", status, re.M)
    hwm = re.search(r"^VmHWM:\s+(\d+)", status, re.M)
    print(f"pid {pid} ({cmd[:100]}): RSS {roll['Rss'] / 1024:.1f} MiB, PSS {roll['Pss'] / 1024:.1f}, "
          f"anon {roll['Anonymous'] / 1024:.1f}, peak RSS {int(hwm.group(1)) / 1024 if hwm else 0:.1f}, "
          f"threads {threads.group(1) if threads else '?'}")  # fmt: skip
    kinds: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    for name, size, rss, pss in maps:
        row = kinds[kind_of(name, size)]
        row[0] += rss
        row[1] += pss
        row[2] += 1
    for kind, (rss, pss, count) in sorted(kinds.items(), key=lambda kv: -kv[1][0]):
        if rss >= 512:
            print(f"    {kind:36s} RSS {rss / 1024:8.1f}  PSS {pss / 1024:8.1f}  ({count} mappings)")
    if top:
        for name, size, rss, pss in sorted(maps, key=lambda m: -m[2])[:top]:
            print(f"      {rss / 1024:8.1f} / {size / 1024:8.1f} MiB  {name or '(anon)'}")
    return roll["Rss"], roll["Pss"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("pids", type=int, nargs="*")
    parser.add_argument("--session", type=int, help="every process whose session id is this")
    parser.add_argument("--top", type=int, default=0, help="also list each process's N largest mappings")
    args = parser.parse_args()
    pids = list(args.pids) + (session_pids(args.session) if args.session else [])
    total_rss = total_pss = 0
    for pid in pids:
        if pid == os.getpid():
            continue
        rss, pss = describe(pid, args.top)
        total_rss += rss
        total_pss += pss
    print(f"total over {len(pids)} processes: RSS {total_rss / 1024:.1f} MiB, PSS {total_pss / 1024:.1f} MiB")


if __name__ == "__main__":
    main()
