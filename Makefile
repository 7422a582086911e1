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

.PHONY: setup demo test lint format shell clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(DEPS_STAMP): requirements.txt | $(PY)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements.txt 2>&1 \
	  | { grep -v "^WARNING: Location" || true; }
	$(PY) -c "import torch, rclpy, grpc"
	touch $@

# msg/ -> ROS interfaces; the package, launch and config files and ros2-run launchers,
# all installed into the venv prefix (symlinked, so source edits are live).
# (proto_gen first: the configure step runs setup.py egg_info, which lists its package)
$(BUILD_STAMP): $(DEPS_STAMP) physis_ros/link/proto_gen/physis_pb2_grpc.py CMakeLists.txt package.xml setup.py $(MSGS)
	rm -rf build
	AMENT_PREFIX_PATH=$(CURDIR)/$(VENV) cmake -S . -B build -DCMAKE_PREFIX_PATH=$(CURDIR)/$(VENV) \
	  -DCMAKE_INSTALL_PREFIX=$(CURDIR)/$(VENV) -DPython3_EXECUTABLE=$(CURDIR)/$(PY) \
	  -DBUILD_TESTING=OFF -DAMENT_CMAKE_SYMLINK_INSTALL=ON -Wno-dev > build.log 2>&1 \
	  || { tail -40 build.log; exit 1; }
	cmake --build build -j2 >> build.log 2>&1 || { tail -40 build.log; exit 1; }
	touch $@

# proto/physis.proto -> physis_ros/link/proto_gen/ (git-ignored), before the install below
# links the package's files into the venv.
PROTO_GEN := physis_ros/link/proto_gen/physis_pb2_grpc.py
$(PROTO_GEN): proto/physis.proto proto/generate.py $(DEPS_STAMP)
	$(PY) proto/generate.py > /dev/null

setup: $(BUILD_STAMP) $(PROTO_GEN)
	@# re-install is ~0.2 s and picks up new source files for the symlink install
	@cmake --install build >> build.log 2>&1 || { tail -40 build.log; exit 1; }

demo: setup
	source scripts/env.sh && physis-demo $(DEMO_ARGS)

lint: setup
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .

format: setup
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

test: lint
	source scripts/env.sh && python -m pytest $(PYTEST_ARGS)

shell: setup
	@echo "entering a shell with the venv and generated interfaces on the path (exit to leave)"
	@bash --rcfile <(echo 'source ~/.bashrc 2>/dev/null; source scripts/env.sh; PS1="(physis) $$PS1"')

clean:
	rm -rf build build.log
