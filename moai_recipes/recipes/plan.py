"""Dry run of the planner: how a run would execute on a flavor, decided on this machine in seconds.

    python -m recipes.plan flavor=4xlarge model=llama3_70b batch_size=512 max_seq_len=4096
    python -m recipes.plan flavor=small model=llama3_8b method=lora lora.rank=16

Builds nothing real: the architecture comes from the model config (or model.checkpoint_dir's
config.json), activations are traced on fake tensors. Prints the candidates and the choice, MoAI
style; `output_dir=DIR` also writes DIR/plan.json. When nothing fits: exit code 2, naming the
smallest flavor or the settings that would. `longest=true` prints instead the longest samples the flavor trains
(every sample of the global batch that long) and the plan that does it.
"""

import sys
import time
from pathlib import Path

from moai_recipes.config.compose import load_config
from moai_recipes.errors import UserError, exit_on_user_error
from moai_recipes.files import write_json
from moai_recipes.flavors import resolve_flavor
from moai_recipes.planner.search import GiB, choose_plan, longest_row
from moai_recipes.inputs import read_inputs


SHOWN = 30  # rows of the candidates' table: those that fit, fastest first, then the closest to fitting


@exit_on_user_error
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cfg = load_config("plan", argv if any(a.startswith("output_dir=") for a in argv) else [*argv, "output_dir=-"])
    flavor = resolve_flavor(**cfg.flavor)
    # What the run would read, as the training recipes read it, but nothing downloaded: a model only on the
    # Hub is planned from its config's architecture.
    inputs = read_inputs(cfg, flavor, dry=True, output=False)
    start = time.perf_counter()
    if cfg.longest:
        return _print_longest(inputs, flavor, cfg, start)
    choice = choose_plan(inputs.workload, flavor, forced=cfg.plan)
    print(f"Flavor {flavor.describe()}")
    print("\n".join(inputs.describe(cfg)))
    n, active = inputs.spec.num_params(), inputs.spec.num_params(active=True)
    experts = f" ({_size(active)} active a token)" if active < n else ""
    print(f"{cfg.method} fine-tuning of {_size(n)} parameters{experts}, global batch {cfg.batch_size} x "
          f"{cfg.max_seq_len} tokens")
    print(f"{'PP':>3} {'schedule':>16} {'TP':>3} {'DP':>4} {'EP':>3} {'CP':>3} {'mbs':>4} {'accum':>5} {'packed':>6} "
          f"{'recompute':>9} {'replica':>7} {'reshard':>7} {'offload':>7} "
          f"{'chunked':>7} {'compile':>7} {'peak GiB':>9} {'s/step':>9} {'MFU':>5}  fits")
    shown = choice.ranked(SHOWN)
    for c in shown:
        p = c.plan
        mark = " <- chosen" if c is choice.chosen else ""
        print(f"{p.pipeline_stages:>3} {p.pipeline_schedule:>16} {p.tensor_parallel:>3} {p.data_parallel:>4} "
              f"{p.expert_parallel:>3} {_context(p):>3} {p.micro_batch_size:>4} {p.accumulation_steps:>5} {str(p.packing):>6} "
              f"{p.recompute:>9} "
              f"{str(p.replicate):>7} {str(p.reshard_after_forward):>7} {str(p.cpu_offload):>7} {str(p.chunked_loss):>7} "
              f"{str(p.compile):>7} {c.memory.total / GiB:>9.2f} {c.time.total_s:>9.3g} {100 * c.mfu:>4.0f}%  "
              f"{'yes' if c.fits else 'no'}{mark}")
    if len(choice.candidates) > len(shown):
        where = ("plan.json lists the best 200" if cfg.output_dir != "-"
                 else "output_dir=DIR writes the best 200 to DIR/plan.json")
        print(f"... and {len(choice.candidates) - len(shown):,} more, slower or further from fitting ({where})")
    print("\n".join(choice.report()))
    print(f"Configuration for parallelism is selected: {choice.chosen.plan.describe()}")
    print(f"Planned in {time.perf_counter() - start:.2f} s")
    if cfg.output_dir != "-":
        Path(cfg.output_dir).mkdir(parents=True, exist_ok=True)
        write_json(Path(cfg.output_dir) / "plan.json", choice.as_dict())
    return 0


def _print_longest(inputs, flavor, cfg, start: float) -> int:
    """longest=true: the longest samples a plan of the flavor trains (search.longest_row), and the plan."""
    print(f"Flavor {flavor.describe()}")
    print("\n".join(inputs.describe(cfg)))
    found = longest_row(inputs.workload, flavor, forced=cfg.plan)
    what = f"{cfg.method} fine-tuning, global batch {cfg.batch_size}"
    if found is None:
        raise UserError(f"not even 1,024-token samples fit {flavor.name} ({what}); a larger flavor, a smaller batch or "
                        "LoRA would")
    tokens, choice = found
    chosen = choice.chosen
    print(f"Longest samples {flavor.name} trains ({what}): {tokens:,} tokens, predicted {chosen.time.total_s:,.3g} "
          f"s/step, peak {chosen.memory.total / GiB:.1f} GiB per device, MFU {100 * chosen.mfu:.0f}%")
    print(f"Configuration for parallelism is selected: {chosen.plan.describe()}")
    print(f"Searched in {time.perf_counter() - start:.2f} s")
    if cfg.output_dir != "-":
        Path(cfg.output_dir).mkdir(parents=True, exist_ok=True)
        write_json(Path(cfg.output_dir) / "plan.json", {**choice.as_dict(), "longest_tokens": tokens})
    return 0


def _context(plan) -> str:
    """The context-parallel degree and the first letter of its way (2u: ulysses over 2 devices, 2g: gather)."""
    return f"{plan.context_parallel}{plan.context_parallel_way[0]}" if plan.context_parallel > 1 else "1"


def _size(count: int) -> str:
    return f"{count / 1e9:.3g}B" if count >= 1e9 else f"{count / 1e6:.3g}M"


if __name__ == "__main__":
    sys.exit(main())

