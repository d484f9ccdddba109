"""What each test of the suite costs in CPU-seconds, the processes it starts included.

On a 2-core machine the suite's wall time is about its CPU-seconds over two (both workers stay busy), so this is the
figure a suite-time decision needs, per test and per module. A test's share is read around it in its pytest worker:
the worker's own time (in-process runs), the fresh processes it started and reaped (subprocess.run: RUSAGE_CHILDREN),
and its zygote's (tests/zygote.py: the forked runs, counted once the zygote reaped them, as it does when each ends).
A module's fixtures count in its first test that uses them. Not seen: a process its parent never reaped (the bare
workers of a launcher a test killed, taken over by init), and time a test waited for a core the other worker held.

    python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder -p bench.test_cpu   # appends to test-cpu.jsonl
    python bench/test_cpu.py test-cpu.jsonl --top 40                                      # the table

MOAI_TEST_CPU=FILE writes elsewhere. py-spy's view of the same suite, by kind of work: bench/suite_profile.py.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import sys
import time
from pathlib import Path

import pytest


def _zygote_seconds() -> float:
    """CPU-seconds of this worker's zygote and of the runs it forked and reaped (0 before it started)."""
    from tests import helpers

    zygote = helpers._ZYGOTE[0] if helpers._ZYGOTE else None
    if zygote is None or zygote.poll() is not None:
        return 0.0
    try:
        fields = Path(f"/proc/{zygote.pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")  # utime, stime, cutime, cstime


def _now() -> tuple[float, float, float]:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime, _zygote_seconds()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    start, before = time.perf_counter(), _now()
    yield
    after = _now()
    own, children, zygote = (max(0.0, b - a) for a, b in zip(before, after))
    row = {"test": item.nodeid, "wall": round(time.perf_counter() - start, 3), "own": round(own, 3),
           "children": round(children, 3), "zygote": round(zygote, 3)}
    with open(os.environ.get("MOAI_TEST_CPU", "test-cpu.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\n")


def table(rows: list[dict], top: int) -> str:
    cpu = lambda row: row["own"] + row["children"] + row["zygote"]  # noqa: E731
    modules = collections.defaultdict(lambda: [0.0, 0.0, 0])
    for row in rows:
        m = modules[row["test"].split("::")[0]]
        m[0], m[1], m[2] = m[0] + cpu(row), m[1] + row["wall"], m[2] + 1
    total = sum(map(cpu, rows))
    lines = [f"{len(rows)} tests, {total:.0f} CPU-seconds (in pytest's workers {sum(r['own'] for r in rows):.0f}, "
             f"fresh processes {sum(r['children'] for r in rows):.0f}, forked runs "
             f"{sum(r['zygote'] for r in rows):.0f}), {sum(r['wall'] for r in rows):.0f} s of the workers' wall time",
             "", "| module | CPU-s | share | wall s | tests |", "|---|---:|---:|---:|---:|"]
    for name, (c, w, n) in sorted(modules.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"| {name} | {c:.1f} | {100 * c / total:.1f}% | {w:.1f} | {n} |")
    lines += ["", "| test | CPU-s | own | fresh | forked |", "|---|---:|---:|---:|---:|"]
    for row in sorted(rows, key=lambda r: -cpu(r))[:top]:
        lines.append(f"| {row['test']} | {cpu(row):.1f} | {row['own']:.1f} | {row['children']:.1f} | "
                     f"{row['zygote']:.1f} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log", type=Path, nargs="?", default=Path("test-cpu.jsonl"))
    parser.add_argument("--top", type=int, default=30, help="modules and tests listed (default 30)")
    args = parser.parse_args()
    if not args.log.is_file():
        print(f"no {args.log}: run the suite with -p bench.test_cpu first (see this file's docstring)",
              file=sys.stderr)
        return 2
    print(table([json.loads(line) for line in args.log.read_text().splitlines() if line.strip()], args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
