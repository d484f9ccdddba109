"""Calibration from use: every run records what it predicted and measured; `moai calibrate` refits the planner's
constants to those records and the planner uses them. Run: pytest tests/test_calibration.py"""

import json
import os
import subprocess
import sys

import pytest

from moai_recipes.planner import calibration
from moai_recipes.planner.cpu_speed import speed_key
from moai_recipes.planner.memory import predict_memory
from moai_recipes.planner.search import choose_plan
from moai_recipes.planner.timing import combine
from tests.helpers import ROOT, run_recipe, setup

TRUE_SCALES = {"matmul": 1.6, "memory": 0.7, "dispatch": 1.3, "parameters": 2.0}
TRUE_MEMORY = 1.12


def moai(*args, home):
    env = {**os.environ, "MOAI_HOME": str(home)}
    return subprocess.run([sys.executable, "-m", "moai_recipes.tools.cli", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def pin_cpu_speed(cache) -> None:
    """This machine's measured speed, replaced by fixed figures in its cache file: the synthetic runs' terms, and
    so how well they tell the scales apart, must not depend on how busy the machine was when it was measured (the
    memory bandwidth measured 37 and 58 GB/s in two sessions here)."""
    pinned = {"fp32_flops": 1.9e11, "bytes_per_s": 5.0e10, "bf16_flops": 4.2e11}
    cache.mkdir(parents=True)
    (cache / "cpu-speed.json").write_text(json.dumps({speed_key(threads): pinned for threads in (1, 2)}))


def synthetic_runs() -> list[dict]:
    """Runs of the tiny model's plans whose 'measurements' follow known scales, with a deterministic +-4% noise: the
    planner's own terms and memory, as a run records them."""
    runs = []
    for i, (model, batch, seq, dtype) in enumerate([
            ("tiny", 8, 256, "fp32"), ("tiny", 32, 64, "fp32"), ("tiny", 4, 512, "fp32"), ("tiny", 8, 256, "bf16"),
            ("smollm2_135m", 4, 128, "fp32"), ("smollm2_135m", 2, 64, "bf16")]):
        cfg, spec, flavor = setup(f"model={model}", f"batch_size={batch}", f"max_seq_len={seq}", f"dtype={dtype}")
        from moai_recipes.planner.plan import Workload

        work = Workload(spec=spec, batch_size=batch, seq_len=seq, dtype=dtype)
        # Fewer layer traces to make (a second each, cold): no recomputation, chunked loss or packing.
        candidates = choose_plan(work, flavor, forced={"recompute": "none", "chunked_loss": False,
                                                        "packing": False}).candidates
        for j, c in enumerate(candidates[:8]):
            noise = 1 + 0.04 * ((i * 7 + j * 3) % 5 - 2) / 2
            memory = predict_memory(c.plan, work, "cpu")
            traced = memory.activations + memory.logits
            runs.append(calibration.run_entry(
                {"device": "cpu", "kind": "cpu", "recipe": "full", "flavor": "cpu", "plan": c.plan.as_dict()},
                time_terms=c.time.terms, memory=memory,
                measured_step_s=combine(c.time.terms, "cpu", TRUE_SCALES)["total_s"] * noise,
                measured_peak_bytes=int((memory.allocated - traced + TRUE_MEMORY * traced) * noise)))
    return runs


def test_too_few_runs_is_a_user_error(tmp_path):
    home = tmp_path / "home"
    (home / "calibration").mkdir(parents=True)
    (home / "calibration" / "runs.jsonl").write_text(json.dumps({"device": "cpu", "kind": "cpu"}) + "\n")
    one = moai("calibrate", home=home)
    assert one.returncode == 2 and "needs 3 at least" in one.stderr and "Traceback" not in one.stderr


def test_calibrate_recovers_the_machine_and_the_planner_uses_it(tmp_path, monkeypatch):
    home = tmp_path / "home"
    (home / "calibration").mkdir(parents=True)
    monkeypatch.setenv("MOAI_CACHE", str(tmp_path / "cache"))
    pin_cpu_speed(tmp_path / "cache")
    runs = synthetic_runs()
    (home / "calibration" / "runs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in runs) + "{damaged\n")
    monkeypatch.setenv("MOAI_HOME", str(home))
    report = "\n".join(calibration.calibrate())
    fit = json.loads((home / "calibration" / "fit.json").read_text())["cpu"]
    # The scales the runs tell apart come back within the noise and the prior's pull; the step-time error falls from
    # the defaults'. (Memory time grows with the tokens as matmul time does: these runs barely tell it apart, and
    # the prior holds it nearer 1.)
    for term in ("matmul", "dispatch"):
        assert fit["scales"][term] == pytest.approx(TRUE_SCALES[term], rel=0.1), (term, fit["scales"])
    assert fit["scales"]["offload"] == pytest.approx(1.0, abs=0.01)  # no run offloads: the default stays
    assert fit["scales"][calibration.MEMORY] == pytest.approx(TRUE_MEMORY, rel=0.05)
    error = fit["error"]["step time"]
    assert error["runs"] == len(runs) and error["before"] > 0.2 and error["after"] < 0.05 and error["held_out"] < 0.06
    assert "step time" in report and "calibrated" in report and "held out" in report

    out = tmp_path / "plan"
    r = run_recipe("model=tiny", "flavor=cpu", f"output_dir={out}", module="recipes.plan", env={"MOAI_HOME": str(home)})
    assert r.returncode == 0, r.stderr
    calibrated = json.loads((out / "plan.json").read_text())["chosen"]  # planned with the machine's scales
    assert calibrated["time"]["scales"]["matmul"] == fit["scales"]["matmul"]
    assert calibrated["predicted_step_s"] == pytest.approx(
        combine(calibrated["time"]["terms"], "cpu", fit["scales"])["total_s"])
    assert calibrated["predicted_step_s"] != pytest.approx(combine(calibrated["time"]["terms"], "cpu")["total_s"])
    reset = moai("calibrate", "--reset", home=home)
    assert reset.returncode == 0 and not (home / "calibration" / "fit.json").exists() and "default" in reset.stdout
    # This process planned with the fit (recipes.plan ran in it) and another removed it: its next plan has the
    # defaults, and so has every later test's in this process (the synthetic scales are not kept in a cache).
    assert calibration.scales("cpu") == {}
