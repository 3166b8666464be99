#!/usr/bin/env python3
"""Merge pytest junit XML files into one: a <testsuites> holding every input's <testsuite>s.

gpu_run.sh runs the GPU suite as concurrent pytest groups (scripts/gpu_test_groups.txt), one XML a
group; the device returns at most 8 files and scripts/guarantee_matrix.py reads any <testsuite>s, so
one merged file carries the run. A missing or unreadable input (a group killed before pytest wrote
its XML) is reported on stderr and named in the output's properties, never dropped silently.

    python scripts/merge_junit.py OUT.xml IN1.xml IN2.xml ...
"""
from __future__ import annotations

import sys
import xml.etree.ElementTree as ET


def merge(paths: list[str]) -> tuple[ET.Element, list[str]]:
    """(the merged <testsuites>, the inputs that could not be read)."""
    root = ET.Element("testsuites")
    missing = []
    for p in paths:
        try:
            tree = ET.parse(p).getroot()
        except (OSError, ET.ParseError) as e:
            print(f"merge_junit: {p}: {e}", file=sys.stderr)
            missing.append(p)
            continue
        suites = [tree] if tree.tag == "testsuite" else list(tree.iter("testsuite"))
        for ts in suites:
            ts.set("source", p.rsplit("/", 1)[-1])  # which group's file, for reading the merged one
            root.append(ts)
    if missing:
        props = ET.SubElement(root, "properties")
        for p in missing:
            ET.SubElement(props, "property", name="missing_input", value=p.rsplit("/", 1)[-1])
    return root, missing


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    root, missing = merge(argv[1:])
    ET.ElementTree(root).write(argv[0], encoding="utf-8", xml_declaration=True)
    tests = sum(int(ts.get("tests", 0)) for ts in root.iter("testsuite"))
    bad = sum(int(ts.get("failures", 0)) + int(ts.get("errors", 0)) for ts in root.iter("testsuite"))
    print(f"merge_junit: {len(argv) - 1 - len(missing)} of {len(argv) - 1} files, {tests} tests, {bad} failed or errors -> {argv[0]}")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
