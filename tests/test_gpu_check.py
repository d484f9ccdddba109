"""The prepared device check (scripts/gpu_check.py) run on the CPU at tiny sizes, so that it never rots between the
sessions that are lent a GPU: every kernel check passes against its reference, and each shape's training run (full
fine-tuning, two steps) runs and prints the planner's peak within 10% of the measured one; torchtune's recipe and ours
run the same job side by side, the same first loss; a GRPO round reports its sampling time beside the planner's; the
tests marked gpu are collected and skip.
Run: pytest tests/test_gpu_check.py (about 45 s)"""

import json
import subprocess
import sys

from tests.helpers import ROOT, command_env


def test_the_device_check_runs_its_whole_sequence_on_the_cpu(tmp_path):
    out = tmp_path / "check"
    # What an earlier check left in the same folder (a rerun after a fix, as on a lent GPU): torchtune's recipe
    # refuses a log folder that exists, and a run would resume from its step checkpoints.
    (out / "torchtune" / "torchtune-r1").mkdir(parents=True)
    (out / "runs" / "llama-full" / "checkpoints").mkdir(parents=True)
    (out / "runs" / "llama-full" / "checkpoints" / "stale").write_text("from the last check")
    r = subprocess.run([sys.executable, "scripts/gpu_check.py", "--cpu", "--out", str(out), "--methods", "full",
                        "--steps", "2"], cwd=ROOT, env=command_env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert [c["name"] for c in report["checks"]] == ["grouped_experts", "packed_attention", "fused_adamw",
                                                     "adamw_8bit", "nf4_lora", "compile", "activation_offload"]
    assert all(c["ok"] and c["error"] is None for c in report["checks"]), report["checks"]
    assert len(report["runs"]) == 3 and all(run["returncode"] == 0 for run in report["runs"]), report["runs"]
    assert all(abs(run["peak_off_pct"]) <= 10 for run in report["runs"]), report["runs"]
    assert report["versions"]["torch"] == __import__("torch").__version__ and report["card"].startswith("CPU")
    side = report["torchtune"]
    assert side["returncode"] == 0 and side["torchtune_tokens_per_s"] > 0 and side["ours_tokens_per_s"] > 0, side
    assert abs(side["torchtune_first_loss"] - side["ours_first_loss"]) <= 1e-4 * side["ours_first_loss"], side
    grpo = report["grpo"]
    assert grpo["returncode"] == 0 and grpo["measured_sampling_s"] > 0 and grpo["predicted_kv_cache_bytes"] > 0, grpo
    assert report["gpu_tests"]["returncode"] == 0 and "9 skipped" in report["gpu_tests"]["summary"], report["gpu_tests"]
    assert not (out / "runs" / "llama-full" / "checkpoints" / "stale").exists()
    text = (out / "report.md").read_text()
    assert "| packed_attention | ok |" in text and "| torchtune side by side |" in text and "| GRPO round |" in text
