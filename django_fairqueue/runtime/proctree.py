"""A machine's process tree, read from ``/proc`` (Linux): what ``testing.run_worker`` kills
past its timeout and what the pipeline benchmark adds up the CPU time of. Elsewhere, and where
``/proc`` cannot be read, there is no tree: :func:`read` returns None."""

from __future__ import annotations

import os


def stat(pid: int) -> list[str]:
    """Fields of /proc/PID/stat after the command name (state is [0], ppid [1]): the command
    may hold spaces and parentheses, so it is cut at the last one."""
    with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fields:
        return fields.read().rsplit(")", 1)[1].split()


def read() -> dict[int, list[str]] | None:
    """Every process's :func:`stat` fields, by pid (a process gone meanwhile is left out);
    None if ``/proc`` cannot be read."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return None
    found: dict[int, list[str]] = {}
    for entry in entries:
        if entry.isdigit():
            try:
                fields = stat(int(entry))
                int(fields[1])  # a ppid: descendants() reads it
            except (OSError, ValueError, IndexError):
                continue
            found[int(entry)] = fields
    return found


def descendants(root: int, tree: dict[int, list[str]]) -> list[int]:
    """The pids below ``root`` in ``tree`` (from :func:`read`), children before their own."""
    children: dict[int, list[int]] = {}
    for pid, fields in tree.items():
        children.setdefault(int(fields[1]), []).append(pid)
    found: list[int] = []
    todo = [root]
    while todo:
        below = children.get(todo.pop(), [])
        found.extend(below)
        todo.extend(below)
    return found
