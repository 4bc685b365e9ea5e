"""Summarise a run: ``python summarize.py RESULTS.xml`` (pytest's --junitxml output).

Prints one line per test (outcome, node id, the first line of the failure message) and then the
failures grouped by message, most frequent first. Standard library only.

    scripts/vllm_omni_tests/run.sh /src/vllm-omni --junitxml=/tmp/vo.xml
    python scripts/vllm_omni_tests/summarize.py /tmp/vo.xml
"""

from __future__ import annotations

import re
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict


def _first_line(message: str) -> str:
    for line in message.splitlines():
        line = line.strip()
        if line:
            line = re.sub(r"127\.0\.0\.1:\d+", "127.0.0.1:PORT", line)
            line = re.sub(r"\b(video|chatcmpl|cmpl|img)[-_][0-9a-f]{16,}\b", r"\1-ID", line)
            return line[:300]
    return ""


def main(path: str) -> int:
    rows = []
    for case in ET.parse(path).iter("testcase"):
        module = case.get("classname", "").replace(".", "/") + ".py"
        node = f"{module}::{case.get('name')}"
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                message = _first_line(child.get("message") or child.text or "")
        rows.append((outcome, node, message))

    counts: dict[str, int] = defaultdict(int)
    for outcome, node, message in rows:
        counts[outcome] += 1
        print(f"{outcome:8} {node}" + (f"  | {message}" if message and outcome != "passed" else ""))
    print()
    print(", ".join(f"{n} {k}" for k, n in sorted(counts.items())))

    groups: dict[str, list[str]] = defaultdict(list)
    for outcome, node, message in rows:
        if outcome in ("failed", "error"):
            groups[message].append(node)
    if groups:
        print("\nFailures by message:")
        for message, nodes in sorted(groups.items(), key=lambda kv: -len(kv[1])):
            print(f"\n[{len(nodes)}] {message}")
            for node in nodes:
                print(f"    {node}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print(__doc__)
        sys.exit(2)
    sys.exit(main(sys.argv[1]))
