"""``physis-bench <subcommand> [flags]``: dispatches lazily to ``physis_ros.bench.<name>``.

Each subcommand module has ``main(argv: list[str]) -> int``. Nothing is imported for a
subcommand that does not run, so ``physis-bench link`` never imports torch.
"""

from __future__ import annotations

import importlib
import sys

from physis_ros.cli_errors import cli_main

SUBCOMMANDS = {
    "engine": (
        "physis_ros.bench.engine",
        "engine interval/latency/efficiency on this machine (torch)",
    ),
    "link": ("physis_ros.bench.link", "robot <-> workstation link round trip (no torch)"),
    "ros": ("physis_ros.bench.ros", "ROS 2 node throughput and latency (no torch)"),
    "serve": (
        "physis_ros.bench.serve",
        "the real server's admission and promises against what streams get",
    ),
}


def _usage() -> str:
    lines = ["usage: physis-bench <subcommand> [flags]   (physis-bench <subcommand> --help)", ""]
    lines += [f"  {name:8s} {desc}" for name, (_, desc) in SUBCOMMANDS.items()]
    return "\n".join(lines)


@cli_main("physis-bench")
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"physis-bench: unknown subcommand {name!r}\n{_usage()}", file=sys.stderr)
        return 2
    module_name = SUBCOMMANDS[name][0]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name != module_name:
            raise
        print(
            f"physis-bench: subcommand {name!r} is not built yet ({module_name})", file=sys.stderr
        )
        return 2
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
