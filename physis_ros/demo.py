"""`make demo`: the main job on the embedded default.

The closed-loop demo (sim robot + server + bridge) lands with the ROS nodes issue; until
then this says so instead of printing anything that looks like a result.
"""

import sys


def main() -> int:
    print(
        "physis-demo: the closed-loop demo (sim_robot + physis-serve + bridge) is not built "
        "yet; see the open issue 'ROS 2 nodes: robot-side bridge, messages, launch, rviz, "
        "and the demo'.",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    sys.exit(main())
