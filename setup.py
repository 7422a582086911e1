"""Python packaging for physis_ros.

Two ways in: the ROS build (CMakeLists.txt installs this package beside the generated
messages and reads `console_scripts` below for `ros2 run` launchers), and a plain
`pip install .[serve]` on a GPU workstation without ROS (engine + server only).
Pinned versions live in requirements.txt; the names here are unpinned on purpose.
"""

import runpy
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

CONSOLE_SCRIPTS = [
    "physis-bench = physis_ros.bench.cli:main",
    "physis-demo = physis_ros.demo:main",
    "physis-serve = physis_ros.serve.main:main",
    "physis-torchrun = physis_ros.tools.torchrun:main",
    "bridge = physis_ros.nodes.bridge:main",
    "sim_robot = physis_ros.nodes.sim_robot:main",
    "physis-sim = physis_ros.tools.sim_cli:main",
    "physis-profile = physis_ros.tools.profile_cli:main",
    "physis-record = physis_ros.sim.record:main",
    "physis-train = physis_ros.train.train:main",
    "physis-train-wam = physis_ros.train.wam:main",
    "physis-eval = physis_ros.eval.cli:main",
    "physis-replay = physis_ros.eval.replay:main",
    "physis-embed = physis_ros.tools.embed_cli:main",
]


class BuildPyWithProto(build_py):
    """Generates the wire code (physis_ros.link.proto_gen) from proto/ while building: into
    the build tree for a wheel, into the source tree for an editable install. The generated
    package is never read from the source tree here, so a clean clone builds."""

    def run(self):
        super().run()
        generate = runpy.run_path(str(Path(__file__).resolve().parent / "proto" / "generate.py"))
        if self.editable_mode:
            generate["generate"]()
        else:
            generate["generate"](Path(self.build_lib) / "physis_ros" / "link" / "proto_gen")


# The generated wire code needs at least the runtime of the grpcio-tools that generated it
# (pinned in pyproject.toml's build requirements).
WIRE = ["grpcio>=1.85.1", "protobuf>=7.35.1,<8"]

PACKAGES = find_packages(include=["physis_ros", "physis_ros.*"], exclude=["*.proto_gen"])

setup(
    name="physis_ros",
    version="0.1.0",
    description="Noisy-history stage pipeline for large world(-action) models, with ROS 2 nodes",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=PACKAGES,
    package_data={
        "physis_ros": ["py.typed"],
        "physis_ros.weights": ["*.safetensors"],
    },
    cmdclass={"build_py": BuildPyWithProto},
    install_requires=["numpy", "PyYAML"],
    extras_require={
        # workstation: engine, distributed runtime, server front end
        "serve": [
            "torch",
            "safetensors",
            *WIRE,
            "grpcio-health-checking",
            "prometheus-client",
            "pillow",
        ],
        # robot side link client (no torch)
        "link": WIRE,
        "eval": ["rosbags", "pillow", "tqdm", "scikit-image"],
        # workstation, optional: the real Wan VAE codec (diffusers) and physis-embed's text
        # encoder (transformers); never needed on the robot
        "models": ["diffusers", "transformers"],
    },
    entry_points={"console_scripts": CONSOLE_SCRIPTS},
    zip_safe=False,
)
