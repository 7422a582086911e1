"""Starting a training run from a physis-train checkpoint, also one with another patch size.

A checkpoint of the same model configuration loads as it is. One that differs only in the
patch size (a finer token grid over the same latent) loads with its patch embedding and
output head resized the FlexiViT way: the new embedding of a patch is the old embedding of a
uniform patch (a sum over the old sub-positions), the new head the mean of the old head's
sub-positions, so a flat region maps as before; every other tensor (blocks, time and text
embeddings, action conditioning) is the trained one. One trained with a plain x0 head starts an
``anchor_residual`` model with its head zeroed and the anchor gate at 1 (the model then starts
as copy-last-frame, with the trained blocks). The caller says which model the checkpoint was
trained as (``train.checkpoint_config`` reads it from its metadata).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from safetensors.torch import load_file

from physis_ros.engine.config import ModelConfig
from physis_ros.engine.model import WanDiT, load_upstream_state_dict


def load_init(model: WanDiT, path: str | Path, trained_as: ModelConfig) -> str:
    """Load checkpoint ``path``, trained as ``trained_as`` (``train.checkpoint_config``), into
    ``model`` (see the module docstring); returns how."""
    old = trained_as
    new = model.cfg
    state = load_file(str(path), device="cpu")
    if new.anchor_residual and "head.anchor_gate" not in state:
        # a plain x0 head (the preset before anchor_residual): its output is a frame, not a
        # change; the head starts at zero, so the model starts as copy-last exactly
        old = dataclasses.replace(old, anchor_residual=True)
        state = {k: v.float() for k, v in state.items()}
        for key in ("head.head.weight", "head.head.bias"):
            state[key] = torch.zeros_like(state[key])
        state["head.anchor_gate"] = torch.ones(new.patch_dim)
        if dataclasses.replace(old, name=new.name) != new:
            raise ValueError(f"{path} was trained as {old}; it cannot start {new.name}")
        load_upstream_state_dict(model, state)
        return "plain x0 head -> anchor residual (head zeroed: copy-last)"
    if dataclasses.replace(old, name=new.name) == new:
        load_upstream_state_dict(model, state)
        return "as trained"
    if dataclasses.replace(old, name=new.name, patch=new.patch) != new:
        raise ValueError(
            f"{path} was trained as {old}; it starts {new.name} only if they differ in the "
            "patch size alone"
        )
    state = {k: v.float() for k, v in state.items()}
    state["patch_embedding.weight"] = _resize_embedding(state["patch_embedding.weight"], new)
    for key in ("head.head.weight", "head.head.bias"):
        state[key] = _resize_head(state[key], old, new)
    load_upstream_state_dict(model, state)
    return f"patch {old.patch} resized to {new.patch}"


def _ratio(old: tuple[int, int, int], new: tuple[int, int, int]) -> tuple[int, int, int]:
    if any(o % n for o, n in zip(old, new, strict=True)):
        raise ValueError(f"patch {new} does not divide the checkpoint's patch {old}")
    return tuple(o // n for o, n in zip(old, new, strict=True))


def _resize_embedding(weight: torch.Tensor, new: ModelConfig) -> torch.Tensor:
    """[D, C, pt, ph, pw] (Conv3d layout) -> [D, C, *new.patch]: sums of sub-patches."""
    d, c = weight.shape[:2]
    rt, rh, rw = _ratio(tuple(weight.shape[2:]), new.patch)
    nt, nh, nw = new.patch
    w = weight.reshape(d, c, nt, rt, nh, rh, nw, rw)
    return w.sum(dim=(3, 5, 7))


def _resize_head(tensor: torch.Tensor, old: ModelConfig, new: ModelConfig) -> torch.Tensor:
    """Head rows laid out (pt, ph, pw, c) upstream -> the new patch's: means of sub-patches."""
    rt, rh, rw = _ratio(old.patch, new.patch)
    nt, nh, nw = new.patch
    rest = tensor.shape[1:]
    w = tensor.reshape(nt, rt, nh, rh, nw, rw, old.in_channels, *rest)
    return w.mean(dim=(1, 3, 5)).reshape(nt * nh * nw * old.in_channels, *rest)
