"""Python packaging for physis_ros.

Two ways in: the ROS build (CMakeLists.txt installs this package beside the generated
messages and reads `console_scripts` below for `ros2 run` launchers), and a plain
`pip install .[serve]` on a GPU workstation without ROS (engine + server only).
Pinned versions live in requirements.txt; the names here are unpinned on purpose.
"""

from setuptools import find_packages, setup

CONSOLE_SCRIPTS = [
    "physis-demo = physis_ros.demo:main",
]

setup(
    name="physis_ros",
    version="0.1.0",
    description="Noisy-history stage pipeline for large world(-action) models, with ROS 2 nodes",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["physis_ros", "physis_ros.*"]),
    package_data={"physis_ros": ["py.typed"]},
    install_requires=["numpy", "PyYAML"],
    extras_require={
        # workstation: engine, distributed runtime, server front end
        "serve": ["torch", "safetensors", "grpcio", "grpcio-health-checking", "protobuf"],
        # robot side link client (no torch)
        "link": ["grpcio", "protobuf"],
        "eval": ["rosbags", "pillow", "tqdm"],
    },
    entry_points={"console_scripts": CONSOLE_SCRIPTS},
    zip_safe=False,
)
