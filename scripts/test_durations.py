"""Write tests/durations.json, the seconds each unit of the suite's work took (a test file, or the
files that share a stack: tests/conftest.py's SHARED_STACK_FILES), from a JUnit XML report of a
whole run:

    scripts/test --junitxml=/tmp/junit.xml
    .venv/bin/python scripts/test_durations.py /tmp/junit.xml

The suite's scheduler hands out the longest units first (tests/conftest.py), so the two processes
end together: handed out by test count, the files of a few slow tests (the e2e ones) came last,
and one process ran alone for the last minutes. Rounded to whole seconds: the order is what
matters, and a file's time drifts with the machine.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.conftest import SHARED_STACK_FILES  # noqa: E402


def main(report: str) -> None:
    seconds: Counter[str] = Counter()
    for case in ET.parse(report).iter("testcase"):
        module = case.get("classname", "")
        # "tests.e2e.test_apply" or "tests.e2e.test_apply.TestClass": the file's dotted path
        parts = module.split(".")
        while parts and not (ROOT / Path(*parts)).with_suffix(".py").exists():
            parts.pop()
        if not parts:
            continue
        path = str(Path(*parts).with_suffix(".py"))
        seconds[SHARED_STACK_FILES.get(path, path)] += float(case.get("time", 0))
    target = ROOT / "tests" / "durations.json"
    target.write_text(json.dumps({unit: round(s) for unit, s in seconds.most_common()},
                                 indent=0) + "\n")
    print(f"{target}: {len(seconds)} units, {sum(seconds.values()):.0f} s in all")


if __name__ == "__main__":
    main(sys.argv[1])
