"""Each test file's seconds (setup + call + teardown of its tests) from the output of a
`pytest ... --durations=0` run, as the JSON tests/conftest.py orders the files by:

    python -m pytest tests -n 2 --dist loadfile --no-loadscope-reorder --durations=0 > LOG
    python tests/file_seconds.py LOG > tests/file_seconds.json
"""
import collections
import json
import re
import sys


def file_seconds(lines, least: float = 5.0) -> dict[str, int]:
    per: collections.Counter = collections.Counter()
    for line in lines:
        m = re.match(r"\s*([\d.]+)s (call|setup|teardown)\s+(\S+?)::", line)
        if m:
            per[m.group(3)] += float(m.group(1))
    return {f: round(t) for f, t in per.most_common() if t >= least}


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        print(json.dumps(file_seconds(f), indent=1))
