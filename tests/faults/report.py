"""Print the figures of a fault-suite run as the Markdown table of docs/reliability.md.

    FAIRQUEUE_FAULT_SCALE=full FAIRQUEUE_FAULT_REPORT=faults.json pytest -m faults tests/faults
    python -m tests.faults.report faults.json

(``python3 dev.py tox -e faults`` does both.)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

COLUMNS = [
    ("messages", "messages"),
    ("processes", "processes x threads"),
    ("kills", "kills / restarts"),
    ("duplicates", "ran twice"),
    ("lost", "lost"),
    ("concurrency", "max concurrency vs cap"),
    ("rate", "throughput"),
]


def _cell(key: str, f: dict[str, Any]) -> str:
    if key == "messages":
        return str(f.get("messages", f.get("accepted", "")))
    if key == "kills":
        if "kills" in f:
            return str(f["kills"])
        if "restarts" in f:
            return f"{f['restarts']} restart, {f['downtime_seconds']} s down"
        if "stale_messages" in f:
            return f"SIGSTOP with {f['stale_messages']} in flight"
        return "0"
    if key == "duplicates":
        text = str(f.get("duplicates", ""))
        if f.get("unexplained_duplicates") is not None:
            text += f" (by live workers: {f['unexplained_duplicates']})"
        return text
    if key == "concurrency":
        if "cap_max" in f:
            over = f["max_concurrency_over_cap"]
            return f"{f['max_concurrency']} (caps 1-{f['cap_max']}; over cap: {over})"
        if "most_claims_in_1s" in f:
            return f"{f['most_claims_in_1s']} claims/s per channel (allowed {f['allowed_in_1s']})"
        if "capped_channel_running_after" in f:
            return f"capped channel's running count after: {f['capped_channel_running_after']}"
        if "hot_backlog_max" in f:
            return f"backlog {f['hot_backlog_max']} (max {f['max_backlog']})"
        return ""
    if key == "rate":
        if "throughput_ratio" in f:
            return (
                f"{f['held_per_second']}/s vs {f['normal_per_second']}/s "
                f"(ratio {f['throughput_ratio']})"
            )
        if "per_second_median" in f:
            return f"{f['per_second_median']}/s median, {f['per_second_min']}/s worst 2 s"
        if "messages_per_second" in f:
            return f"{f['messages_per_second']}/s"
        return ""
    return str(f.get(key, ""))


def table(figures: dict[str, dict[str, Any]]) -> str:
    lines = [
        "| scenario | scale | " + " | ".join(title for _, title in COLUMNS) + " |",
        "| --- | --- |" + " --- |" * len(COLUMNS),
    ]
    for name in sorted(figures):
        f = figures[name]
        cells = [name, f.get("scale", "")] + [_cell(key, f) or "—" for key, _ in COLUMNS]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    figures = json.loads(Path(argv[0]).read_text())
    print(table(figures))
    print()
    for name in sorted(figures):
        print(f"{name}: " + json.dumps(figures[name], sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
