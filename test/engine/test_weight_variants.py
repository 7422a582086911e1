"""A diffusers directory that holds its weights more than once (diffusers' variants: the plain
files beside ``.fp16`` ones, single or sharded with an index) loads the one --variant names,
else the one --dtype names, else the plain files; a variant asked for and absent is refused
naming the files present."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from wan_fixtures import make_diffusers_wan

from physis_ros.engine import checkpoints as ck
from physis_ros.engine.build import build_model
from physis_ros.engine.threads import local_engine
from physis_ros.serve import main as serve_main
from physis_ros.serve.spec import ServingSpec

LAYOUT = dict(latent_frames=2, resolution="64x64")
PLAIN = "diffusion_pytorch_model.safetensors"
KEY = "blocks.1.attn1.to_q.weight"
"""A diffusers key and its upstream name, whose value tells the files apart."""
OURS = "blocks.1.self_attn.q.weight"


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """(config.json path, the plain weights) of a tiny diffusers transformer."""
    root = tmp_path_factory.mktemp("variants")
    make_diffusers_wan(root / "src")
    src = root / "src" / "transformer"
    return src / "config.json", load_file(str(src / PLAIN))


def _directory(tmp_path, plain, *, single=(), sharded=(), with_plain=True):
    """A diffusers pipeline directory: the plain files (unless not ``with_plain``), a
    single-file variant per name in ``single`` and a two-shard one with its index per name in
    ``sharded``; variant V's tensors are the plain ones + its rank (fp16 +1, bf16 +2, ...) in
    its dtype, so what loaded says which."""
    config, state = plain
    d = tmp_path / "pipe" / "transformer"
    d.mkdir(parents=True)
    shutil.copy(config, d / "config.json")
    if with_plain:
        save_file(state, str(d / PLAIN))
    for offset, name in enumerate((*single, *sharded), start=1):
        dtype = torch.bfloat16 if name == "bf16" else torch.float16
        shifted = {k: (v + offset).to(dtype) for k, v in state.items()}
        if name in single:
            save_file(shifted, str(d / f"diffusion_pytorch_model.{name}.safetensors"))
            continue
        keys, weight_map = sorted(shifted), {}
        for i in range(2):
            shard = f"diffusion_pytorch_model.{name}-{i + 1:05d}-of-00002.safetensors"
            part = {k: shifted[k] for k in keys[i::2]}
            save_file(part, str(d / shard))
            weight_map.update(dict.fromkeys(part, shard))
        index = d / f"diffusion_pytorch_model.safetensors.index.{name}.json"
        index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return d.parent


def _loaded_offset(directory, plain, **choice) -> float:
    """Which files loaded: the offset of a loaded tensor from the plain one."""
    resolved = ck.resolve_model(str(directory), **LAYOUT, **choice)
    model = build_model(resolved.cfg)
    ck.load_weights(model, resolved.weights)
    got = model.state_dict()[OURS]
    return round((got - plain[1][KEY]).mean().item(), 2)


def test_the_dtype_or_the_variant_chooses_the_files(tmp_path, plain):
    d = _directory(tmp_path, plain, single=("fp16",), sharded=("bf16",))
    assert _loaded_offset(d, plain) == 0.0  # no dtype: the plain files
    assert _loaded_offset(d, plain, dtype="float32") == 0.0
    assert _loaded_offset(d, plain, dtype="float16") == 1.0  # fp16 names its variant
    assert _loaded_offset(d, plain, dtype="bfloat16") == 2.0  # sharded, through its index
    assert _loaded_offset(d, plain, variant="bf16", dtype="float16") == 2.0  # the flag wins
    files = ck.resolve_model(str(d), **LAYOUT, variant="bf16").weights.files
    assert [p.name for p in files] == [
        "diffusion_pytorch_model.bf16-00001-of-00002.safetensors",
        "diffusion_pytorch_model.bf16-00002-of-00002.safetensors",
    ]


def test_plain_files_serve_a_dtype_without_its_variant(tmp_path, plain):
    d = _directory(tmp_path, plain, sharded=("fp16",))
    assert _loaded_offset(d, plain, dtype="bfloat16") == 0.0
    only = _directory(tmp_path / "only", plain, single=("fp16",), with_plain=False)
    assert _loaded_offset(only, plain, dtype="float32") == 1.0  # the only weights there are


def test_a_variant_that_is_not_there_is_refused_naming_the_files(tmp_path, plain):
    d = _directory(tmp_path, plain, single=("fp16",))
    with pytest.raises(ValueError, match="no weights of variant 'ema'") as err:
        ck.resolve_model(str(d), **LAYOUT, variant="ema")
    assert PLAIN in str(err.value) and "diffusion_pytorch_model.fp16.safetensors" in str(err.value)
    two = _directory(tmp_path / "two", plain, single=("fp16", "bf16"), with_plain=False)
    with pytest.raises(ValueError, match="variants bf16, fp16 and none without a variant"):
        ck.resolve_model(str(two), **LAYOUT, dtype="float32")


def test_the_engine_and_the_serving_spec_load_the_variant(tmp_path, plain):
    d = _directory(tmp_path, plain, single=("fp16",))
    with local_engine(str(d), **LAYOUT, steps=2, dtype="float16") as engine:
        got = engine.model.state_dict()[OURS].float()
    assert torch.equal(got, (plain[1][KEY] + 1).half().float())
    spec = ServingSpec(model=str(d), variant="fp16", **LAYOUT).resolve()
    assert ServingSpec.from_json(spec.to_json()).variant == "fp16"
    assert spec.runtime_config(1).resolved.weights.files[0].name.endswith(".fp16.safetensors")
    assert "variant fp16" in ck.summary(
        spec.runtime_config(1).resolved, spec.sampler(), torch.float16
    )


def test_physis_serve_refuses_an_absent_variant_before_loading(capsys, tmp_path, plain):
    d = _directory(tmp_path, plain, single=("fp16",))
    argv = ["--model", str(d), "--variant", "bf16", "--resolution", "64x64", "--port", "0"]
    assert serve_main.main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "no weights of variant 'bf16'" in err, err
    assert f"files present: diffusion_pytorch_model.fp16.safetensors, {PLAIN}" in err
