"""Prompts: text embeddings computed once, outside the control loop, and what a stream gets.

A prompt-embeddings file (written by ``physis-embed``, or by ``write_prompts``) is safetensors:
one tensor per prompt, ``prompt.<name>`` [n, text_dim], holding the text encoder's output for
the prompt's real tokens only (the encoder ran with its attention mask; padding is not stored);
the metadata says what made it::

  format   "physis_ros prompt embeddings"      version  "1"
  encoder  what computed them (a path or name) text_dim, text_len (the encoder's max tokens)
  texts    JSON {name: prompt text}

The name ``empty`` is the embedding of the empty prompt "" (physis-embed always writes it):
what a stream without a prompt is conditioned on. The engine pads every conditioning to the
model's ``text_len`` with zeros (``model.pad_text``), as upstream Wan and diffusers do.

``PromptBook`` is what a server holds: the named prompts of its files, the model's empty
prompt, and the check of raw embeddings a client sends in ``OpenStream``.
"""

from __future__ import annotations

import base64
import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from physis_ros.contract.model import WamContract, prompt_features
from physis_ros.engine.config import ModelConfig
from physis_ros.engine.forward import make_cond

FORMAT = "physis_ros prompt embeddings"
VERSION = "1"
EMPTY = "empty"
"""The reserved name of the empty prompt's embedding."""
PREFIX = "prompt."
NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
RAW_DTYPES = ("float32", "float16")


@dataclass(frozen=True)
class PromptFile:
    path: Path
    embeddings: dict[str, torch.Tensor]
    """name -> [n, text_dim] float32."""
    texts: dict[str, str]
    encoder: str
    text_dim: int


def check_name(name: str) -> str:
    if not NAME.match(name):
        raise ValueError(f"prompt name {name!r}: use 1-64 of A-Z a-z 0-9 _ . -")
    return name


def write_prompts(
    path: str | Path,
    embeddings: dict[str, torch.Tensor],
    *,
    texts: dict[str, str],
    encoder: str,
    text_len: int,
) -> None:
    """Write named embeddings [n, text_dim] (real tokens only) with what made them."""
    dims = {int(t.shape[-1]) for t in embeddings.values()}
    if len(dims) != 1 or any(t.dim() != 2 for t in embeddings.values()):
        raise ValueError(f"embeddings must all be [n, text_dim] with one text_dim, got {dims}")
    tensors = {
        PREFIX + check_name(n): t.detach().to("cpu").contiguous() for n, t in embeddings.items()
    }
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "encoder": encoder,
        "text_dim": str(dims.pop()),
        "text_len": str(text_len),
        "texts": json.dumps({n: texts.get(n, "") for n in embeddings}),
    }
    save_file(tensors, str(path), metadata=meta)


def read_prompts(path: str | Path) -> PromptFile:
    """A prompt-embeddings file, checked (ValueError naming the file and the problem)."""
    path = Path(path)
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            meta = f.metadata() or {}
            if meta.get("format") != FORMAT:
                raise ValueError(
                    f"{path}: not a prompt-embeddings file (format {meta.get('format')!r})"
                )
            if meta.get("version") != VERSION:
                raise ValueError(f"{path}: version {meta.get('version')!r}, this reads {VERSION}")
            embeddings = {}
            for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                if not key.startswith(PREFIX):
                    raise ValueError(f"{path}: unexpected tensor {key!r}")
                t = f.get_tensor(key)
                if t.dim() != 2 or not torch.isfinite(t).all():
                    raise ValueError(f"{path}: {key} must be a finite [n, text_dim] tensor")
                embeddings[check_name(key[len(PREFIX) :])] = t.float()
    except (SafetensorError, OSError) as err:
        raise ValueError(f"{path}: cannot read prompt embeddings: {err}") from err
    text_dim = int(meta.get("text_dim", 0))
    if any(t.shape[1] != text_dim for t in embeddings.values()):
        raise ValueError(f"{path}: an embedding's width differs from text_dim {text_dim}")
    return PromptFile(
        path, embeddings, json.loads(meta.get("texts", "{}")), meta.get("encoder", ""), text_dim
    )


def trained_empty_prompt(
    cfg: ModelConfig, checkpoint_meta: dict[str, str] | None
) -> torch.Tensor | None:
    """The empty prompt of a model without a text encoder: for a physis-train checkpoint the
    conditioning it was trained with (metadata ``cond_seed``: ``forward.make_cond``); for
    random weights, or a model conditioned on its task's values, no tokens (all padding: the
    engine's own measuring streams; physis-serve refuses a client's stream without them)."""
    if checkpoint_meta and "cond_seed" in checkpoint_meta:
        return make_cond(cfg, int(checkpoint_meta["cond_seed"]))
    return torch.zeros(0, cfg.text_dim)


class PromptBook:
    """The conditioning a server can give a stream: by name, raw, or the empty prompt."""

    def __init__(
        self,
        cfg: ModelConfig,
        files: list[str | Path] | tuple = (),
        *,
        empty: torch.Tensor | None = None,
        contract: WamContract | None = None,
    ) -> None:
        """``empty``: the model's empty prompt when no file has one (None: the model needs a
        file with it, e.g. a Wan checkpoint, whose empty prompt is its text encoder's)."""
        self.cfg = cfg
        self.contract = contract
        """A world-action model's contract: a ``task_features`` prompt is made of the
        stream's task values."""
        self.prompts: dict[str, torch.Tensor] = {}
        self.sources: dict[str, str] = {}
        for path in files:
            pf = read_prompts(path)
            if pf.text_dim != cfg.text_dim:
                raise ValueError(
                    f"{path}: embeddings of width {pf.text_dim}, model {cfg.name} takes "
                    f"{cfg.text_dim}"
                )
            for name, t in pf.embeddings.items():
                if name in self.prompts and not torch.equal(self.prompts[name], t):
                    raise ValueError(f"prompt {name!r} is in {self.sources[name]} and {path}")
                self.prompts[name] = self._fit(t, f"{path}: prompt {name!r}")
                self.sources[name] = str(path)
        if EMPTY not in self.prompts and empty is not None:
            self.prompts[EMPTY] = self._fit(empty.float(), "empty prompt")
            self.sources[EMPTY] = "model"

    def names(self) -> list[str]:
        return sorted(self.prompts)

    def resolve(
        self, name: str = "", raw: np.ndarray | None = None, task: dict | None = None
    ) -> torch.Tensor:
        """[n, text_dim] float32 CPU: the raw embedding, the named prompt, the features of
        the stream's ``task`` values (a contract's ``task_features`` prompt), or the empty
        one."""
        spec = self.contract.prompt if self.contract is not None else None
        if task and spec is not None and spec.kind == "task_features":
            if name or raw is not None:
                raise ValueError("give the task's values or a prompt, not both")
            self.contract.check_task(task)
            values = [task[v] for v in spec.values]
            return self._fit(
                torch.from_numpy(prompt_features(values, spec.scale, self.cfg.text_dim)), "task"
            )
        if raw is not None:
            if name:
                raise ValueError("give a prompt name or a raw embedding, not both")
            return self.check_raw(raw)
        key = name or EMPTY
        if key not in self.prompts:
            if key == EMPTY:
                raise ValueError(
                    f"model {self.cfg.name} has no empty-prompt embedding for a stream without "
                    "a prompt: run physis-embed (it writes 'empty') and serve with --prompts FILE"
                )
            raise ValueError(f"unknown prompt {name!r}; the server has {self.names()}")
        return self.prompts[key]

    def check_raw(self, raw: np.ndarray) -> torch.Tensor:
        if not isinstance(raw, np.ndarray) or raw.dtype.name not in RAW_DTYPES:
            kind = raw.dtype.name if isinstance(raw, np.ndarray) else type(raw).__name__
            raise ValueError(f"prompt embedding must be {' or '.join(RAW_DTYPES)}, got {kind}")
        if not np.isfinite(raw).all():
            raise ValueError("prompt embedding contains NaN or inf")
        return self._fit(torch.from_numpy(raw.astype(np.float32)), "prompt embedding")

    def _fit(self, t: torch.Tensor, what: str) -> torch.Tensor:
        cfg = self.cfg
        if t.dim() != 2 or t.shape[1] != cfg.text_dim or t.shape[0] > cfg.text_len:
            raise ValueError(
                f"{what} has shape {list(t.shape)}, model {cfg.name} takes "
                f"[n <= {cfg.text_len}, {cfg.text_dim}]"
            )
        return t.contiguous()


def cond_to_json(cond: torch.Tensor) -> dict:
    """A conditioning tensor for a JSON control message: float32 little-endian, base64."""
    arr = cond.detach().to("cpu", torch.float32).contiguous().numpy().astype("<f4")
    return {"shape": list(arr.shape), "f32": base64.b64encode(arr.tobytes()).decode("ascii")}


def cond_from_json(body: dict) -> torch.Tensor:
    shape = [int(v) for v in body["shape"]]
    data = base64.b64decode(body["f32"], validate=True)
    arr = np.frombuffer(data, dtype="<f4")
    if arr.size != int(np.prod(shape)) or len(shape) != 2:
        raise ValueError(f"conditioning of {arr.size} values does not fill shape {shape}")
    return torch.from_numpy(arr.reshape(shape).astype(np.float32))
