"""``python -m geotrain.planner plan|profile ...``: the planner's commands without geotrain's CLI."""

import argparse
import sys

from geotrain.planner.command import add_plan_arguments, add_profile_arguments, run_plan, run_profile


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m geotrain.planner")
    commands = parser.add_subparsers(dest="command", required=True)
    add_plan_arguments(commands.add_parser("plan", help="choose VMs to rent"))
    add_profile_arguments(commands.add_parser("profile", help="write a measured model profile"))
    args = parser.parse_args(argv)
    return run_plan(args) if args.command == "plan" else run_profile(args)


if __name__ == "__main__":
    sys.exit(main())
