"""How long a run takes to start on a large data file, the first time and once its tokens are cached, and how
much memory a run holds with the data read whole or streamed.

    python bench/data_start.py                       # 100,000 chat rows; streaming also on 1,000,000 (~4 min)
    python bench/data_start.py --rows 20000 --stream-rows 0      # a quick look

The data: chat rows (a system turn on every third, one to three user/assistant exchanges, answers of 5 to
120 words), written as JSONL with a seeded generator. The model: the tiny demo checkpoint, so that what
the data costs is not hidden under what the model costs. Each job is `python -m recipes.full_finetune
dataset=chat dataset.path=FILE max_steps=2` in a new process with its own MOAI_CACHE:

  first       an empty cache: tokenise every row, write the cache
  cached      the same command again: map the cached tokens
  no-cache    dataset.cache=false: tokenise in memory, as before the cache existed
  streamed    dataset.streaming=true: read blocks of shuffle_buffer rows as training goes (also on a file of
              --stream-rows rows: what a stream holds does not grow with the file)

Measured: the wall time from the start of the process to its first step's line ("time to start"), the
time the run itself reports for reading the data, and the peak resident memory of the process (RSS,
of the process and any worker it starts, sampled every 20 ms with psutil). Each job runs --rounds times, alternating; medians and the spread.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
WORDS = ("the model reads a file of rows and learns from the answers given in each conversation while the planner "
         "chooses how every step runs on the devices of the flavor with the same global batch").split()


def write_chat(path: Path, rows: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    say = lambda lo, hi: " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi))).capitalize() + "."
    with path.open("w") as f:
        for i in range(rows):
            messages = [{"role": "system", "content": say(4, 12)}] if i % 3 == 0 else []
            for _ in range(rng.randint(1, 3)):
                messages += [{"role": "user", "content": say(5, 40)}, {"role": "assistant", "content": say(5, 120)}]
            f.write(json.dumps({"messages": messages}) + "\n")


def run(data: Path, cache: Path, out: Path, *extra: str) -> dict:
    cmd = [sys.executable, "-m", "recipes.full_finetune", "logger=stdout", "dataset=chat", f"dataset.path={data}",
           "max_steps=2", "batch_size=16", "max_seq_len=512", "sample_max_new_tokens=0", f"output_dir={out}", *extra]
    env = {**os.environ, "MOAI_CACHE": str(cache), "WANDB_SILENT": "true", "PYTHONUNBUFFERED": "1"}
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peak, ps = 0, psutil.Process(proc.pid)
    done = threading.Event()

    def sample():
        nonlocal peak
        while not done.is_set():
            try:  # the launcher and its workers, if it starts any
                tree = [ps, *ps.children(recursive=True)]
                peak = max(peak, sum(p.memory_info().rss for p in tree))
            except psutil.Error:
                pass
            time.sleep(0.02)

    sampler = threading.Thread(target=sample)
    sampler.start()
    first_step, lines = None, []
    for line in proc.stdout:
        lines.append(line)
        if first_step is None and line.startswith("[Step 1/"):
            first_step = time.perf_counter() - start
    proc.wait()
    done.set()
    sampler.join()
    if proc.returncode != 0:
        sys.exit("".join(lines[-20:]))
    data_line = next((line for line in lines if line.startswith("Data ")), "")
    return {"start_s": first_step, "peak_rss_mib": peak / 2**20, "data_line": data_line.strip()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--stream-rows", type=int, default=1_000_000, help="a second, larger file streamed (0: none)")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="moai-data-start-"))
    data = tmp / f"chat-{args.rows}.jsonl"
    write_chat(data, args.rows)
    files = {"": data}
    if args.stream_rows:
        files["big"] = tmp / f"chat-{args.stream_rows}.jsonl"
        write_chat(files["big"], args.stream_rows)
    for f in files.values():
        print(f"{f.name}: {f.stat().st_size / 2**20:.1f} MiB", flush=True)
    results: dict[str, list[dict]] = {}
    for r in range(args.rounds):
        jobs = [("first", data, ()), ("cached", data, ()), ("no-cache", data, ("dataset.cache=false",)),
                ("streamed", data, ("dataset.streaming=true",))]
        if args.stream_rows:
            jobs.append((f"streamed {args.stream_rows} rows", files["big"], ("dataset.streaming=true",)))
        cache = tmp / f"cache-{r}"
        order = jobs if r % 2 == 0 else [jobs[0], jobs[1], *reversed(jobs[2:])]  # first, cached: in that order
        for name, path, extra in order:
            res = run(path, cache, tmp / f"out-{r}-{len(results.get(name, []))}-{name.replace(' ', '_')}", *extra)
            results.setdefault(name, []).append(res)
            print(f"round {r + 1} {name:>24}: start {res['start_s']:.1f} s, peak RSS {res['peak_rss_mib']:.0f} MiB | "
                  f"{res['data_line'][:150]}", flush=True)
    print(f"\n{'job':>26} | {'time to first step (s)':>24} | {'peak RSS (MiB)':>16}")
    for name, rs in results.items():
        start = [r["start_s"] for r in rs]
        rss = [r["peak_rss_mib"] for r in rs]
        print(f"{name:>26} | {statistics.median(start):>12.1f} ({min(start):.1f}-{max(start):.1f}) | "
              f"{statistics.median(rss):>8.0f} ({min(rss):.0f}-{max(rss):.0f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
