"""`moai`: the tools around the recipes, after the MoAI Platform's moreh-smi and moreh-switch-model.

    moai flavors                      every flavor, the default starred
    moai switch [FLAVOR]              choose the default flavor (a numbered list without FLAVOR)
    moai smi                          the current flavor as one accelerator and the recipes running on it
    moai ls                           the recipes, their configs and the options of each group
    moai cp CONFIG DEST               copy a config to edit (full_finetune, model/mistral)
    moai validate CONFIG [KEY=VALUE]  compose and check a config without training
    moai run RECIPE [KEY=VALUE]       run a recipe from any folder (full_finetune, lora_finetune, dpo, plan, generate, export, eval)
    moai generate [KEY=VALUE]         moai run generate: sample from a checkpoint
    moai calibrate [--reset]          refit the planner's constants to the runs this machine recorded

Installed as the console script `moai`; `python -m moai_recipes.tools.cli` is the same.
Test: `python -m pytest tests/test_cli.py -q`.
"""

import argparse
import os
import sys

from moai_recipes.config.shipped_flavors import (
    catalog,
    current_flavor,
    current_option,
    find,
    flavors_table,
    numbered_list,
)
from moai_recipes.config.user_settings import save_flavor
from moai_recipes.errors import UserError, exit_on_user_error

SWITCHED = 'The MoAI Accelerator model is successfully switched to  "{}".'  # moreh-switch-model's words, two spaces too


def flavors(args) -> int:
    print("\n".join(flavors_table(catalog(), current_option())))
    return 0


def switch(args) -> int:
    options = catalog()
    if args.flavor is not None:
        chosen = find(args.flavor, options)  # a UserError before anything is saved
        save_flavor(chosen.option)
        print(SWITCHED.format(chosen.name))
        return 0
    current = current_option()
    names = {o.option: o.name for o in options}
    print(f"Current MoAI Accelerator: {names.get(current, current)}\n")
    print("\n".join(numbered_list(options, current)) + "\n")
    while True:
        try:
            answer = input(f"Selection (1-{len(options)}, q, Q): ").strip()
        except EOFError:  # input closed: leave as q does
            print()
            return 0
        if answer in ("q", "Q"):
            return 0
        if answer.isdigit() and 1 <= int(answer) <= len(options):
            chosen = options[int(answer) - 1]
            save_flavor(chosen.option)
            current = chosen.option
            print(SWITCHED.format(chosen.name) + "\n")
            print("\n".join(numbered_list(options, current)) + "\n")
        elif answer:
            print(f"'{answer}' is not a choice: enter a number from 1 to {len(options)}, or q to leave. Nothing changed.\n")


def smi(args) -> int:
    from moai_recipes.tools.smi import smi_lines

    print("\n".join(smi_lines(current_flavor(catalog()))))
    return 0


def ls(args) -> int:
    from moai_recipes.tools.config_files import ls_lines

    print("\n".join(ls_lines()))
    return 0


def cp(args) -> int:
    from moai_recipes.tools.config_files import copy_config, how_to_use

    src, target = copy_config(args.config, args.dest)
    print(f"Copied {src} to {target}.")
    print("\n".join(how_to_use(src, target)))
    return 0


def validate(args) -> int:
    from moai_recipes.tools.config_files import validate as check

    for line in check(args.config, args.overrides):
        print(line, flush=True)  # what passed stays on screen when a later check fails
    return 0


def calibrate(args) -> int:
    from moai_recipes.planner.calibration import calibrate as refit

    print("\n".join(refit(reset=args.reset)))
    return 0


def run(recipe: str | None, args: list[str]) -> int:
    """`python -m moai_recipes.launch RECIPE ARGS`: the installed recipe, from any folder."""
    from moai_recipes.tools.config_files import recipes

    if recipe not in recipes():
        raise UserError(f"{'no recipe ' + repr(recipe) if recipe else 'name a recipe'}: valid recipes are "
                        f"{', '.join(recipes())} (moai ls shows their configs)")
    sys.stdout.flush()
    os.execv(sys.executable, [sys.executable, "-m", "moai_recipes.launch", recipe, *args])


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moai", description="Tools around the moai-recipes: flavors, status, configs, running recipes.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.add_parser("flavors", help="every flavor in a table, the default starred").set_defaults(run=flavors)
    s = sub.add_parser("switch", help="choose the flavor recipes use when the command line names none")
    s.add_argument("flavor", nargs="?", help="e.g. 4xlarge or 4xLarge.2048GB; without it, choose from a numbered list")
    s.set_defaults(run=switch)
    sub.add_parser("smi", help="the current flavor, its memory and utilisation, the recipes running").set_defaults(run=smi)
    sub.add_parser("ls", help="the recipes, their configs and the options of each group").set_defaults(run=ls)
    c = sub.add_parser("cp", help="copy a config to edit, then run it with --config-path/--config-name")
    c.add_argument("config", help="a recipe's config (full_finetune) or a group option (model/mistral)")
    c.add_argument("dest", help="a file (my.yaml) or a folder")
    c.set_defaults(run=cp)
    v = sub.add_parser("validate", help="compose a config and check it (names, values, checkpoint, data) without training")
    v.add_argument("config", help="a recipe's config (full_finetune) or a config file (my.yaml)")
    v.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="as on a recipe's command line: model=mistral ...")
    v.set_defaults(run=validate)
    k = sub.add_parser("calibrate", help="refit the planner's constants to the runs this machine recorded (each run "
                                         "records its predicted and measured peak and step time)")
    k.add_argument("--reset", action="store_true", help="forget the fit: plan with the default constants again")
    k.set_defaults(run=calibrate)
    # Listed for --help only: main hands their command lines, --help and --cfg included, to the recipe.
    sub.add_parser("run", help="run a recipe from any folder: moai run full_finetune flavor=cpu-2 ...")
    sub.add_parser("generate", help="sample from a checkpoint: moai generate model.checkpoint_dir=DIR prompt=...")
    return p


@exit_on_user_error
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["run"]:
        return run(argv[1] if len(argv) > 1 else None, argv[2:])
    if argv[:1] == ["generate"]:
        return run("generate", argv[1:])
    args = parser().parse_args(argv)
    if args.command is None:
        parser().print_help()
        return 0
    try:
        return args.run(args)
    except BrokenPipeError:  # `moai ls | head` left early: end quietly, as other command-line tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the flush at exit must not fail again
        return 0


if __name__ == "__main__":
    sys.exit(main())
