# Source this to get a shell with the project's venv and generated interfaces on the path:
#   source scripts/env.sh
# The one place that knows which variables the installed ROS wheels and messages need.
_physis_root="$(cd "$(dirname "${BASH_SOURCE[0]:-$0}")/.." && pwd)"
export VIRTUAL_ENV="$_physis_root/.venv"
export PATH="$VIRTUAL_ENV/bin:$PATH"
# ament_index_python (rclpy, launch files) looks packages up under these prefixes.
export AMENT_PREFIX_PATH="$VIRTUAL_ENV${AMENT_PREFIX_PATH:+:$AMENT_PREFIX_PATH}"
# Generated message libraries are installed into the venv prefix.
export LD_LIBRARY_PATH="$VIRTUAL_ENV/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PYTHONPATH="$_physis_root${PYTHONPATH:+:$PYTHONPATH}"
# Fast DDS: a shared-memory segment large enough for camera images (config/fastdds.xml).
export FASTDDS_DEFAULT_PROFILES_FILE="$_physis_root/config/fastdds.xml"
export RMW_IMPLEMENTATION=rmw_fastrtps_cpp
unset _physis_root
