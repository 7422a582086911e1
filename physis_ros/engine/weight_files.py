"""Which safetensors files of a model directory hold its weights, and which variant of them.

A diffusers directory may hold the same weights more than once, as variants named in the file
names the way diffusers writes them: ``diffusion_pytorch_model.safetensors`` (no variant)
beside ``diffusion_pytorch_model.fp16.safetensors``; sharded, ``NAME.fp16-00001-of-00002
.safetensors`` with the index ``NAME.safetensors.index.fp16.json`` (or
``NAME.fp16.safetensors.index.json``). One variant is loaded: the one asked for by name (as
diffusers' ``variant=``), else the one the serving dtype names (``fp16`` for float16, ``bf16``
for bfloat16) when the directory has it, else the files without a variant, else the only
variant there is. Pickle formats (``.pth``, ``.bin``, ``.pt``) are never loaded.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

PICKLE_SUFFIXES = (".pth", ".pt", ".bin", ".ckpt")
DTYPE_VARIANTS = {"float16": "fp16", "bfloat16": "bf16"}
"""The variant a serving dtype loads when the directory has it (float32: no variant)."""

_WEIGHTS = re.compile(r"^.+?(?:\.(?P<variant>[^.]+?))?(?:-\d+-of-\d+)?\.safetensors$")
_INDEX = re.compile(
    r"^.+?(?:\.(?P<before>[^.]+))?\.safetensors\.index(?:\.(?P<after>[^.]+))?\.json$"
)
NO_VARIANT = ""
MODEL_DIRECTORY, NOT_A_DIRECTORY = "a model directory", "a preset or a physis-train weights file"
FLAGS_BY_MODEL_KIND = {MODEL_DIRECTORY: {"variant"}, NOT_A_DIRECTORY: set()}
"""What a command's ``--variant`` applies to (``cli_errors.refuse_unused_flags``): only a
directory has weight variants."""


def is_model_dir(name_or_path: str) -> bool:
    """True when ``name_or_path`` is not a preset name but a path (a directory to load)."""
    return "/" in name_or_path or Path(name_or_path).is_dir() or name_or_path.startswith(".")


def model_kind(name_or_path: str) -> str:
    """``MODEL_DIRECTORY`` or ``NOT_A_DIRECTORY`` (the keys of ``FLAGS_BY_MODEL_KIND``)."""
    directory = is_model_dir(name_or_path) and not name_or_path.endswith(".safetensors")
    return MODEL_DIRECTORY if directory else NOT_A_DIRECTORY


def variant_of(name: str) -> str | None:
    """The variant a file name carries ("" for none), or None when it is neither weights nor
    an index."""
    m = _INDEX.match(name)
    if m:
        return m.group("before") or m.group("after") or NO_VARIANT
    m = _WEIGHTS.match(name)
    if m:
        return m.group("variant") or NO_VARIANT
    return None


def weight_files(directory: Path, *, variant: str = "", dtype: str = "") -> list[Path]:
    """The safetensors files that hold ``directory``'s weights in the chosen variant (see the
    module): ``variant`` names one (it must be there), ``dtype`` the serving dtype. Raises
    ValueError naming the files present when the choice is absent or ambiguous."""
    groups: dict[str, list[Path]] = {}
    for path in sorted(directory.iterdir()):
        found = variant_of(path.name) if path.is_file() else None
        if found is not None:
            groups.setdefault(found, []).append(path)
    if not groups:
        pickled = sorted(p.name for p in directory.iterdir() if p.suffix in PICKLE_SUFFIXES)
        hint = f" (found {pickled}: pickle formats are never loaded)" if pickled else ""
        raise ValueError(f"{directory}: no safetensors weights{hint}")
    chosen = _choose(directory, groups, variant, dtype)
    return _group_files(directory, groups[chosen])


def _choose(directory: Path, groups: dict[str, list[Path]], variant: str, dtype: str) -> str:
    present = ", ".join(p.name for files in groups.values() for p in files)
    if variant:
        if variant not in groups:
            raise ValueError(
                f"{directory}: no weights of variant {variant!r} (files present: {present})"
            )
        return variant
    for candidate in (DTYPE_VARIANTS.get(dtype), NO_VARIANT):
        if candidate is not None and candidate in groups:
            return candidate
    if len(groups) == 1:
        return next(iter(groups))
    named = ", ".join(sorted(groups))
    raise ValueError(
        f"{directory} holds weights in the variants {named} and none without a variant; "
        f"dtype {dtype or 'float32'} names none of them: choose one with --variant "
        f"(files present: {present})"
    )


def _group_files(directory: Path, group: list[Path]) -> list[Path]:
    """One variant's weight files: those its index names, or its safetensors files."""
    indexes = [p for p in group if p.name.endswith(".json")]
    if len(indexes) > 1:
        raise ValueError(f"{directory}: several safetensors indexes {[p.name for p in indexes]}")
    if not indexes:
        return [p for p in group if p.name.endswith(".safetensors")]
    try:
        weight_map = json.loads(indexes[0].read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise ValueError(f"{indexes[0]}: not a safetensors index ({err})") from err
    files = sorted({directory / name for name in weight_map.values()})
    absent = [p.name for p in files if not p.exists()]
    if absent:
        raise ValueError(f"{indexes[0].name} names shards that are not there: {absent}")
    return files


def partial_load_problem(what: str, loading_info: dict) -> str | None:
    """What is wrong with a ``from_pretrained(..., output_loading_info=True)`` load (diffusers,
    transformers) that left weights at their random init: keys the files lack or hold in
    another shape; None when every weight came from the files. Those libraries only log it,
    and a codec or text encoder that is partly random looks like a model that does not work."""
    missing = sorted(loading_info.get("missing_keys") or ())
    mismatched = sorted(str(k) for k in loading_info.get("mismatched_keys") or ())
    if not (missing or mismatched):
        return None
    parts = [f"missing {len(missing)} key(s) {missing[:8]}"] if missing else []
    if mismatched:
        parts.append(f"mis-shaped {len(mismatched)} key(s) {mismatched[:8]}")
    return f"{what}: its weights files do not hold the model: {'; '.join(parts)}"
