"""Generate physis_ros/link/proto_gen/ from proto/physis.proto (the one place that does).

Called by `make setup` (Makefile) and by setup.py's build_py hook, so both the ROS build and
`pip install .` ship generated code. grpc_tools writes `import physis_pb2` (absolute) into
the *_pb2_grpc.py module; it is rewritten to a package-relative import here, so nothing has
to put the folder on sys.path.

Usage: python proto/generate.py [--out DIR]
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO = ROOT / "proto" / "physis.proto"
DEFAULT_OUT = ROOT / "physis_ros" / "link" / "proto_gen"


def generate(out_dir: Path = DEFAULT_OUT) -> list[Path]:
    """Write physis_pb2.py, physis_pb2.pyi, physis_pb2_grpc.py and __init__.py into out_dir."""
    try:
        from grpc_tools import protoc
    except ImportError as exc:
        raise RuntimeError(
            "generating the wire code needs grpcio-tools (pip install grpcio-tools)"
        ) from exc
    import importlib.resources

    out_dir.mkdir(parents=True, exist_ok=True)
    well_known = str(importlib.resources.files("grpc_tools") / "_proto")
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO.parent}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        str(PROTO),
    ]
    rc = protoc.main(args)
    if rc != 0:
        raise RuntimeError(f"protoc failed ({rc}) on {PROTO}")
    grpc_module = out_dir / "physis_pb2_grpc.py"
    text = grpc_module.read_text()
    fixed = re.sub(r"^import physis_pb2 as", "from . import physis_pb2 as", text, flags=re.M)
    if fixed == text:
        raise RuntimeError(f"did not find the absolute physis_pb2 import in {grpc_module}")
    grpc_module.write_text(fixed)
    (out_dir / "__init__.py").write_text(
        '"""Generated from proto/physis.proto by proto/generate.py; do not edit."""\n'
    )
    return sorted(out_dir.glob("*.py*"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output package folder")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(f"generated {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
