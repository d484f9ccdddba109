"""Where the test suite's CPU goes: every process it starts sampled by py-spy, each sample put in one bucket.

    pip install py-spy
    python bench/suite_profile.py                      # the Makefile's suite command, sampled (slower than plain)
    python bench/suite_profile.py -- tests/test_dpo.py # pytest's arguments after --
    python bench/suite_profile.py --raw suite.raw      # read samples recorded before

py-spy follows the suite's subprocesses (`--subprocesses`): pytest's workers, the forked recipe processes, the fresh
ones, llama.cpp's converter. Each sample (a stack) goes to the first bucket whose pattern it matches, in BUCKETS'
order, so a MemTracker frame inside a training step counts as MemTracker. The table says each bucket's share of all
samples and its busiest processes. Issue 51's suite-time decisions were argued from it (2026-11-29: imports 18%,
training steps 19%, the planner's traces 11%, MemTracker 10% before it followed one step instead of two).
"""

from __future__ import annotations

import argparse
import collections
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUITE = ["-m", "pytest", "-q", "-n", "2", "--dist", "loadfile", "--no-loadscope-reorder"]

# (bucket, pattern on the whole stack): the first that matches takes the sample.
BUCKETS = [
    ("imports", r"_find_and_load"),
    ("MemTracker (measure_memory)", r"peak_memory\.py|mem_tracker\.py"),
    ("planner: layer and head traces", r"planner/activations\.py"),
    ("planner: search and pricing", r"moai_recipes/planner/"),
    ("torch.compile", r"convert_frame|compile_fx|torch/_inductor/|aot_autograd"),
    ("Hydra's compose", r"hydra/compose\.py"),
    ("sampling (answers, rollouts, generate)", r"train/answers\.py|train/rollouts\.py|recipes/generate\.py"),
    ("loss.png", r"plot_loss"),
    ("checkpoints: save and load", r"moai_recipes/checkpoint/|hf_format\.py"),
    ("FSDP2 set-up", r"train/parallel\.py"),
    ("training steps", r"train/loop\.py|grpo_step\.py|preference_step\.py"),
]


def read_raw(path: Path) -> list[tuple[str, int]]:
    """py-spy's raw output: one stack a line, `frame;frame;... count`. A process's command line may hold newlines,
    which split a stack over lines: those are joined until the line ends in a count."""
    stacks, pending = [], ""
    for line in path.read_text(errors="replace").splitlines():
        pending += line
        found = re.search(r" (\d+)$", pending)
        if found and ";" in pending:
            stacks.append((pending[:found.start()], int(found.group(1))))
            pending = ""
        else:
            pending += "\\n"
    return stacks


def bucket(stack: str) -> str:
    return next((name for name, pattern in BUCKETS if re.search(pattern, stack)), "other")


def process(stack: str) -> str:
    """The sampled process's command, shortened: the last `process N:"..."` frame."""
    frames = [f for f in stack.split(";") if f.startswith("process ")]
    if not frames:
        return "?"
    command = frames[-1].split(":", 1)[1].strip('"')
    if " -c import sys" in command.replace("\\n", " ")[:60]:
        return "pytest worker (in-process runs)"  # xdist's execnet worker
    if "-m tests.zygote" in command:
        return "forked from tests/zygote.py"
    words = [re.sub(r"/tmp/\S+", "TMP", w) for w in command.replace("\\n", " ").split()]
    return " ".join(w.rsplit("/", 1)[-1] if w.startswith("/") else w for w in words[:4])[:60] or "(no command line)"


def table(stacks: list[tuple[str, int]]) -> str:
    total = sum(n for _, n in stacks)
    shares, where, kinds = collections.Counter(), collections.defaultdict(collections.Counter), set()
    for stack, n in stacks:
        name, kind = bucket(stack), process(stack)
        shares[name] += n
        where[name][kind] += n
        kinds.add(kind)
    lines = [f"{total} samples, {len(kinds)} kinds of process", "",
             "| bucket | share | samples | busiest processes |", "|---|---:|---:|---|"]
    for name, n in shares.most_common():
        top = ", ".join(f"`{p}` {100 * k / n:.0f}%" for p, k in where[name].most_common(2))
        lines.append(f"| {name} | {100 * n / total:.1f}% | {n} | {top} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--raw", type=Path, help="read these samples instead of recording the suite")
    parser.add_argument("--out", type=Path, default=Path("suite.raw"), help="where to record (default suite.raw)")
    parser.add_argument("--rate", type=int, default=20, help="samples a second (default 20: the suite stays near "
                                                             "its usual time)")
    parser.add_argument("pytest_args", nargs="*", help="after --: pytest's arguments (default: the whole suite)")
    args = parser.parse_args()
    if args.raw is None:
        spy = shutil.which("py-spy")
        if spy is None:
            print("py-spy is not installed: pip install py-spy", file=sys.stderr)
            return 2
        command = [spy, "record", "--subprocesses", "--rate", str(args.rate), "--format", "raw",
                   "--output", str(args.out), "--", sys.executable, *SUITE, *args.pytest_args]
        subprocess.run(command, cwd=ROOT)  # the suite's own result is pytest's to report
        args.raw = args.out
    if not args.raw.is_file():
        print(f"no samples at {args.raw}", file=sys.stderr)
        return 2
    print(table(read_raw(args.raw)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
