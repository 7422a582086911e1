# Two commands matter: `make demo` (set up + run the main job) and `make test`.
# Setup is idempotent: stamps skip the pip install and the cmake build when nothing changed.
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -c
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
DEPS_STAMP := $(VENV)/.requirements-installed
BUILD_STAMP := build/.installed
MSGS := $(wildcard msg/*.msg)
DEMO_ARGS ?=

.PHONY: setup ros-cli heldout demo test test-stress lint format shell clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(DEPS_STAMP): requirements.txt | $(PY)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements.txt 2>&1 \
	  | { grep -v "^WARNING: Location" || true; }
	$(PY) -c "import torch, rclpy, grpc"
	touch $@

# msg/ and proto/ -> ROS interfaces and wire code; the package, launch and config files and
# ros2-run launchers, all installed into the venv prefix (symlinked, so source edits are live).
# Configured once (again when the build description changes); `setup` builds incrementally.
$(BUILD_STAMP): $(DEPS_STAMP) CMakeLists.txt package.xml setup.py $(MSGS)
	rm -rf build
	AMENT_PREFIX_PATH=$(CURDIR)/$(VENV) cmake -S . -B build -DCMAKE_PREFIX_PATH=$(CURDIR)/$(VENV) \
	  -DCMAKE_INSTALL_PREFIX=$(CURDIR)/$(VENV) -DPython3_EXECUTABLE=$(CURDIR)/$(PY) \
	  -DBUILD_TESTING=OFF -DAMENT_CMAKE_SYMLINK_INSTALL=ON -Wno-dev > build.log 2>&1 \
	  || { tail -40 build.log; exit 1; }
	touch $@

# proto/physis.proto -> physis_ros/link/proto_gen/ (git-ignored) in the source tree too, for
# imports from the repository root (scripts/env.sh puts it first on PYTHONPATH).
PROTO_GEN := physis_ros/link/proto_gen/physis_pb2_grpc.py
$(PROTO_GEN): proto/physis.proto proto/generate.py $(DEPS_STAMP)
	$(PY) proto/generate.py > /dev/null

# tf2_msgs/TFMessage (sim_robot's TF) has no PyPI wheel: built from vendor/ into the venv.
TF2_STAMP := $(VENV)/.tf2-msgs-installed
$(TF2_STAMP): $(DEPS_STAMP) $(wildcard vendor/tf2_msgs/*.* vendor/tf2_msgs/msg/*)
	rm -rf build-vendor/tf2_msgs
	{ AMENT_PREFIX_PATH=$(CURDIR)/$(VENV) cmake -S vendor/tf2_msgs -B build-vendor/tf2_msgs \
	    -DCMAKE_PREFIX_PATH=$(CURDIR)/$(VENV) -DCMAKE_INSTALL_PREFIX=$(CURDIR)/$(VENV) \
	    -DPython3_EXECUTABLE=$(CURDIR)/$(PY) -DBUILD_TESTING=OFF -Wno-dev \
	  && cmake --build build-vendor/tf2_msgs -j2 && cmake --install build-vendor/tf2_msgs; } \
	  > build-vendor.log 2>&1 || { tail -40 build-vendor.log; exit 1; }
	touch $@

setup: $(BUILD_STAMP) $(PROTO_GEN) $(TF2_STAMP)
	@# a no-op build and re-install take ~2 s; the install picks up new source files
	@{ AMENT_PREFIX_PATH=$(CURDIR)/$(VENV) cmake --build build -j2 && cmake --install build; } \
	  >> build.log 2>&1 \
	  || { tail -40 build.log; exit 1; }

# The ROS 2 command line and launch system (`ros2 launch`, `ros2 run`, `ros2 topic`) have no
# wheels on PyPI. Where their sources lie beside the repository (as in CI), install them into
# the venv (idempotent, ~20 s the first time); elsewhere the tests that need them are skipped,
# except under CI (CI set), where they fail (test/launching.py).
ROS_CLI_INSTALL := ../shared/ros_cli/install.sh
ros-cli: $(DEPS_STAMP)
	@if [ -x $(ROS_CLI_INSTALL) ]; then $(ROS_CLI_INSTALL) $(VENV); \
	elif [ -n "$$CI" ]; then echo "ros-cli: no $(ROS_CLI_INSTALL); under CI the tests" \
	  "that run ros2 launch/run will fail"; \
	else echo "ros-cli: no $(ROS_CLI_INSTALL); tests that run ros2 launch/run will be skipped"; fi

# Held-out bags for physis-eval: seeds 10000-10009, never used in training (docs/push_wm).
heldout: setup
	source scripts/env.sh && physis-record data/heldout --episodes 10 --seed 10000 \
	  --duration-s 60 --height 32 --width 32

demo: setup
	source scripts/env.sh && physis-demo $(DEMO_ARGS)

lint: setup
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .

format: setup
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# The suite on TEST_WORKERS pytest-xdist workers (how tests are dealt out: test/conftest.py).
# Many tests wait on child processes and paced streams rather than compute, so more workers
# than the 2 cores pay off; TEST_WORKERS=0 runs it in this one process.
TEST_WORKERS ?= 4
PYTEST_XDIST = -n $(TEST_WORKERS)
# the slowest tests are listed at the end: where the suite's time goes, run after run
test: lint ros-cli
	source scripts/env.sh && python -m pytest $(PYTEST_XDIST) --durations=15 $(PYTEST_ARGS)

# The suite with every core kept busy by a background load: no test may depend on an idle
# machine (STRESS_LOAD busy processes per core, default 1).
STRESS_LOAD ?= 1
test-stress: lint ros-cli
	source scripts/env.sh && python scripts/stress.py --load-per-core $(STRESS_LOAD) -- \
	  python -m pytest $(PYTEST_XDIST) $(PYTEST_ARGS)

shell: setup
	@echo "entering a shell with the venv and generated interfaces on the path (exit to leave)"
	@bash --rcfile <(echo 'source ~/.bashrc 2>/dev/null; source scripts/env.sh; PS1="(physis) $$PS1"')

clean:
	rm -rf build build.log build-vendor build-vendor.log
