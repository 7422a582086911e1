"""``physis-train``: world-model training on the live timeline the server runs (DESIGN.md §3).

A training window is what a served stream's chunk sees: ``n_obs`` observed chunks (n_obs drawn
1..``max_context``; clean at sigma 0, or noised with the window's sigma when ``context_noise``
is ``noised``), then ``horizon`` predicted chunks, all at ONE noise level sigma drawn from the
served sampler's levels (at step k a chunk reads its predecessors' noisy states at sigma_k),
x_sigma = (1 - sigma) x0 + sigma eps; block-causal attention over window W. Predicted chunks
are conditioned on the command of the newest observation held over them, as the server does
(it knows no later command). The model predicts the flow-matching velocity eps - x0 (an x0
head through (x - x0) / sigma); the loss is its mean squared error over the predicted chunks'
video values. The forward is ``engine.model.forward_sequence``, the one the oracle samples
with; windows are laid out with their observations ending at a fixed position (unused
leading positions are masked out of attention), so one batch mixes every n_obs.

Reproducible: the same seed, data and step count give the same weights (one CPU thread).
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from tqdm import tqdm

from physis_ros.cli_errors import cli_main, finite_float, refuse_unused_flags
from physis_ros.engine.build import build_model
from physis_ros.engine.config import CONTEXT_NOISE, ModelConfig, SamplerConfig, get_preset
from physis_ros.engine.forward import make_cond
from physis_ros.engine.model import load_upstream_state_dict, to_upstream_state_dict
from physis_ros.engine.sampler import chunk_layout, sigmas, state_numel
from physis_ros.eval.plots import line_chart
from physis_ros.train.bag_mapping import MappingError, load_mapping
from physis_ros.train.data import SequenceSampler, load_dataset
from physis_ros.train.warmstart import load_init
from physis_ros.train.windows import (
    DEFAULT_LOG_FLOOR,
    LOSSES,
    Windows,
    noisy_history_loss,
    shifted,
)
from physis_ros.weights import read_metadata


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything that determines the trained weights (with the data)."""

    model: str = "push-wm"
    """Model preset; its action_mode must be ``condition`` or ``none``."""
    model_overrides: str = ""
    """JSON object of ModelConfig fields that replace the preset's (trials of other shapes;
    the weights then load into that preset with the same overrides)."""
    steps: int = 1000
    """Optimizer steps."""
    batch_size: int = 16
    max_context: int = 5
    """A window has 1..max_context observed chunks (W: what a served chunk can read)."""
    horizon: int = 4
    """Predicted chunks per window: the horizon the weights are served with (metadata)."""
    window: int = 5
    """W: previous chunks each chunk attends to; sampling must use the same W."""
    context_noise: str = "clean"
    """Observed chunks at sigma 0 (``clean``) or noised with the window's sigma (``noised``);
    the server presents them the same way (metadata ``context_noise``)."""
    shift: float = 3.0
    """The schedule's shift. Training sigmas are shift*u / (1 + (shift-1)*u) with u ~ U(0, 1),
    or u on the sampler's grid when ``sample_steps`` is set."""
    sample_steps: int = 4
    """0: sigmas from the continuous shifted schedule; K > 0: sigmas drawn from the K noise
    levels that the K-step sampler (this shift) visits, sigma_0..sigma_{K-1} — all training
    goes to the levels the served model meets; the weights' metadata then names K as the
    steps to serve with."""
    lr: float = 3e-3
    warmup_steps: int = 50
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    action_dropout: float = 0.1
    """Fraction of training sequences whose commanded actions are all zeroed: the model also
    learns to predict when no commands come with the observations (all-zero actions mean
    "unknown"; the shoulder's joint limits exclude a real all-zero command)."""
    ema: float = 0.999
    """Decay of the exponential moving average of the weights that is saved (0: save the
    raw weights). Debiased over the first steps, so short runs are not pulled to the init."""
    save_dtype: str = "float16"
    """dtype of the saved weights (``float16``, ``bfloat16`` or ``float32``); they load into
    a float32 model, and the validation loss at the end is measured with the rounded weights,
    so what is reported is what ships."""
    frame_hz: float = 10.0
    """Camera rate the model learns (bags are subsampled to it)."""
    init: str = ""
    """Start from these weights (a physis-train checkpoint of the same model, or of one with
    another patch size: ``warmstart.load_init``) instead of the seeded initialisation."""
    seed: int = 0
    threads: int = 1
    """torch CPU threads (1: bit-reproducible, and the fastest where the cores are shared)."""
    val_every: int = 50
    max_minutes: float = 0.0
    """0: no limit; otherwise stop after this many minutes (the metadata says where it stopped)."""
    loss: str = "mse"
    """``mse``: the velocity MSE (the x0 error weighted by 1/sigma^2) over the predicted video
    values, which the frames that change most dominate; ``log_mse``: the mean over predicted
    chunks of log(x0 MSE + ``log_floor``), a chunk's PSNR up to sign and scale: each chunk
    counts alike, as in the per-window PSNR a user sees, so a still scene is copied exactly
    rather than blurred."""
    log_floor: float = DEFAULT_LOG_FLOOR
    """``log_mse``: the MSE (on [-1, 1] values) below which a chunk is not pushed further
    (DEFAULT_LOG_FLOOR)."""
    stop_after_steps: int = 0
    """0: run all ``steps``; else stop after this many, with the learning-rate schedule of
    ``steps`` — reproduces exactly a run that ``max_minutes`` cut short at that step."""
    mapping: str = ""
    """A mapping file (YAML, ``physis_ros.train.bag_mapping``): the bags' camera and command
    topics, and the commands' joints in the model's action order ("": the first topic of
    each type, the commands' columns as they come)."""

    def __post_init__(self) -> None:
        checks = {
            "steps": self.steps >= 1,
            "batch_size": self.batch_size >= 1,
            "max_context": self.max_context >= 1,
            "horizon": self.horizon >= 1,
            "window": self.window >= 1,
            "context_noise": self.context_noise in CONTEXT_NOISE,
            "shift": self.shift > 0,
            "sample_steps": self.sample_steps >= 0,
            "lr": self.lr > 0,
            "warmup_steps": self.warmup_steps >= 0,
            "weight_decay": self.weight_decay >= 0,
            "grad_clip": self.grad_clip > 0,
            "action_dropout": 0 <= self.action_dropout <= 1,
            "ema": 0 <= self.ema < 1,
            "save_dtype": self.save_dtype in SAVE_DTYPES,
            "frame_hz": self.frame_hz > 0,
            "seed": self.seed >= 0,
            "threads": self.threads >= 1,
            "val_every": self.val_every >= 1,
            "max_minutes": self.max_minutes >= 0,
            "stop_after_steps": 0 <= self.stop_after_steps <= self.steps,
            "loss": self.loss in LOSSES,
            "log_floor": self.log_floor > 0,
        }
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"{name} has an invalid value: {getattr(self, name)!r}")
        cfg = self.model_config
        if cfg.action_mode == "predict":
            raise ValueError(
                f"model {self.model!r} predicts actions; physis-train trains world models"
            )
        if self.mapping:
            try:
                joints = load_mapping(self.mapping).command.joints
            except MappingError as err:
                raise ValueError(str(err)) from None
            if cfg.action_mode == "condition" and len(joints) != cfg.action_dim:
                raise ValueError(
                    f"mapping {self.mapping}: command joints {list(joints)} are "
                    f"{len(joints)}, model {self.model!r} takes {cfg.action_dim} actions"
                )

    @property
    def model_config(self) -> ModelConfig:
        """The preset with ``model_overrides`` applied (JSON lists become tuples)."""
        try:
            extra = json.loads(self.model_overrides) if self.model_overrides else {}
        except json.JSONDecodeError as err:
            raise ValueError(f"model_overrides is not JSON: {err}") from err
        if not isinstance(extra, dict):
            raise ValueError(f"model_overrides must be a JSON object, got {self.model_overrides}")
        return get_preset(
            self.model, **{k: tuple(v) if isinstance(v, list) else v for k, v in extra.items()}
        )


SAVE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


@torch.no_grad()
def _ema_update(avg: torch.nn.Module, model: torch.nn.Module, decay: float) -> None:
    for a, p in zip(avg.parameters(), model.parameters(), strict=True):
        a.lerp_(p.detach(), 1.0 - decay)


@torch.no_grad()
def _val_loss(model, val: Windows, cfg: TrainConfig) -> float:
    model.eval()
    cond = make_cond(model.cfg, 0).expand(len(val.x0), -1, -1)
    return noisy_history_loss(model, val, cond=cond, **_loss_args(cfg)).item()


def _loss_args(cfg: TrainConfig) -> dict:
    return {
        "window": cfg.window,
        "context_noise": cfg.context_noise,
        "loss": cfg.loss,
        "log_floor": cfg.log_floor,
    }


def _train_sigmas(cfg: TrainConfig, gen: torch.Generator) -> torch.Tensor:
    """[batch_size] noise levels, one per sequence (shared by its noised chunks)."""
    if not cfg.sample_steps:
        return shifted(torch.rand(cfg.batch_size, generator=gen), cfg.shift)
    levels = torch.tensor(
        sigmas(SamplerConfig(steps=cfg.sample_steps, shift=cfg.shift))[:-1], dtype=torch.float32
    )
    return levels[torch.randint(0, cfg.sample_steps, (cfg.batch_size,), generator=gen)]


def _lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    frac = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


def _val_batch(sampler: SequenceSampler, cfg: TrainConfig, size: int) -> Windows:
    """A fixed validation batch: every observed position used (a served stream's steady
    state), sigmas spread over (0.2, 1], fixed noise."""
    gen = torch.Generator().manual_seed(cfg.seed + 99)
    x0 = sampler.batch(size)
    eps = torch.randn(size, x0.shape[1], state_numel(sampler.cfg), generator=gen)
    n_obs = torch.full((size,), cfg.max_context)
    return Windows(x0, n_obs, torch.linspace(0.2, 1.0, size), eps, cfg.horizon)


def _windows(sampler: SequenceSampler, cfg: TrainConfig, gen: torch.Generator) -> Windows:
    """A training batch: windows with n_obs observations (drawn 1..max_context, one draw per
    batch: the batch is only as long as that needs), commands dropped from a fraction of them
    (the model also predicts without commands)."""
    mcfg = sampler.cfg
    n = int(torch.randint(1, cfg.max_context + 1, (1,), generator=gen))
    x0 = sampler.batch(cfg.batch_size)[:, cfg.max_context - n :]
    n_obs = torch.full((cfg.batch_size,), n)
    sigma = _train_sigmas(cfg, gen)
    eps = torch.randn(cfg.batch_size, x0.shape[1], state_numel(mcfg), generator=gen)
    if cfg.action_dropout and mcfg.action_mode == "condition":
        drop = torch.rand(cfg.batch_size, generator=gen) < cfg.action_dropout
        x0[drop, :, chunk_layout(mcfg).actions] = 0.0
    return Windows(x0, n_obs, sigma, eps, cfg.horizon)


def checkpoint_config(path: str | Path) -> ModelConfig:
    """The model configuration a physis-train checkpoint was trained with (its metadata's
    ``model`` and ``train_config.model_overrides``)."""
    meta = read_metadata(path)
    if "model" not in meta:
        raise ValueError(f"{path}: no physis-train metadata (model)")
    overrides = json.loads(meta.get("train_config", "{}")).get("model_overrides", "")
    return TrainConfig(model=meta["model"], model_overrides=overrides).model_config


def train(
    cfg: TrainConfig,
    data_paths: list[str | Path],
    out_dir: str | Path,
    *,
    val_paths: list[str | Path] | None = None,
    progress: bool = True,
) -> dict:
    """Train, write ``weights.safetensors``, ``train_log.json`` and ``loss_curve.png`` into
    ``out_dir``; returns the log."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    mcfg = cfg.model_config
    mapping = load_mapping(cfg.mapping) if cfg.mapping else None
    data, sampler, val = _data(cfg, data_paths, val_paths, mapping=mapping, progress=progress)
    model = build_model(mcfg, seed=cfg.seed).train()
    init_how = load_init(model, cfg.init, checkpoint_config(cfg.init)) if cfg.init else ""
    if mcfg.anchor_residual:
        # the anchor passes through at 1: a learned gate drifts towards 0.5 and the head
        # blurs still scenes again (docs/push_wm/README.md)
        model.head.anchor_gate.requires_grad_(False)
    # the weights that are validated and saved: an EMA of the trained ones (or those)
    shipped = copy.deepcopy(model).eval().requires_grad_(False) if cfg.ema else model
    log: dict = {"train_loss": [], "val_loss": [], "config": asdict(cfg)}
    t0 = time.perf_counter()
    stopped_early = _fit(model, shipped, sampler, val, cfg, log=log, progress=progress)
    model.eval()
    wall_s = time.perf_counter() - t0
    steps_done = len(log["train_loss"])
    # what ships is the rounded weights: measure the validation loss on exactly those
    state = {
        k: v.to(SAVE_DTYPES[cfg.save_dtype]) for k, v in to_upstream_state_dict(shipped).items()
    }
    load_upstream_state_dict(shipped, state)
    final_val = _val_loss(shipped, val, cfg) if val is not None else None
    meta = {
        "format": "physis_ros world model",
        "model": cfg.model,
        "window": str(cfg.window),
        "horizon": str(cfg.horizon),
        "context_noise": cfg.context_noise,
        "frame_hz": str(cfg.frame_hz),
        "image_size": f"{mcfg.image_size[0]}x{mcfg.image_size[1]}",
        "frames_per_chunk": str(mcfg.frames_per_chunk),
        **({"steps": str(cfg.sample_steps)} if cfg.sample_steps else {}),
        "action_names": ",".join(mapping.command.joints) if mapping else "shoulder,elbow",
        "cond_seed": "0",
        "train_config": json.dumps(asdict(cfg)),
        "steps_done": str(steps_done),
        "train_wall_s": f"{wall_s:.1f}",
        "train_frames": str(data.frames),
        "train_episodes": str(len(data.episodes)),
        "torch": torch.__version__,
        **({"init_sha256": _sha256(cfg.init), "init": init_how} if cfg.init else {}),
    }
    save_file(state, str(out / "weights.safetensors"), metadata=meta)
    log.update(
        steps_done=steps_done,
        stopped_early=stopped_early,
        wall_s=wall_s,
        train_episodes=len(data.episodes),
        train_frames=data.frames,
        skipped_bags=data.skipped,
        skipped_messages={f"{t}: {r}": n for (t, r), n in sorted(data.skipped_messages.items())},
        platform=platform.platform(),
        final_train_loss_mean_last50=float(np.mean(log["train_loss"][-50:])),
        final_val_loss=final_val,
    )
    (out / "train_log.json").write_text(json.dumps(log, indent=1) + "\n")
    _plot_losses(out / "loss_curve.png", log, cfg.model)
    return log


def _data(cfg: TrainConfig, data_paths, val_paths, *, mapping, progress: bool) -> tuple:
    """(the training bags' dataset, its sampler, the fixed validation batch or None)."""
    mcfg = cfg.model_config
    read = dict(frame_hz=cfg.frame_hz, progress=progress, mapping=mapping)
    data = load_dataset(data_paths, mcfg, **read)
    _say_skipped(data)
    chunks = cfg.max_context + cfg.horizon
    sampler = SequenceSampler(data, mcfg, chunks=chunks, seed=cfg.seed)
    if not val_paths:
        return data, sampler, None
    val_data = load_dataset(val_paths, mcfg, **read)
    _say_skipped(val_data)
    val_sampler = SequenceSampler(val_data, mcfg, chunks=chunks, seed=cfg.seed + 1)
    return data, sampler, _val_batch(val_sampler, cfg, 32)


def _say_skipped(data) -> None:
    """Bags and messages of ``data`` (a ``data.Dataset``) that could not be used, on stderr."""
    for why in data.skipped:
        print(f"physis-train: bag not used: {why}", file=sys.stderr)
    for (topic, reason), n in sorted(data.skipped_messages.items()):
        print(f"physis-train: {n} messages of {topic} not used: {reason}", file=sys.stderr)


def _fit(model, shipped, sampler, val, cfg: TrainConfig, *, log: dict, progress: bool) -> bool:
    """The optimizer steps (losses into ``log``; ``shipped`` follows as the EMA); True when
    ``stop_after_steps`` or ``max_minutes`` stopped it before ``steps``."""
    # tqdm: an optional dependency (the ``eval`` extra), only for the progress bar

    mcfg = model.cfg
    opt = torch.optim.AdamW(
        model.parameters(), lr=cfg.lr, betas=(0.9, 0.99), weight_decay=cfg.weight_decay
    )
    noise_gen = torch.Generator().manual_seed(cfg.seed + 1)
    t0 = time.perf_counter()
    bar = tqdm(range(cfg.steps), desc="train", unit="step", disable=not progress)
    for step in bar:
        windows = _windows(sampler, cfg, noise_gen)
        cond = make_cond(mcfg, 0).expand(cfg.batch_size, -1, -1)
        for group in opt.param_groups:
            group["lr"] = _lr_at(step, cfg)
        loss = noisy_history_loss(model, windows, cond=cond, **_loss_args(cfg))
        if not torch.isfinite(loss):
            raise FloatingPointError(f"loss is {loss.item()} at step {step}; lower --lr")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        if cfg.ema:
            _ema_update(shipped, model, min(cfg.ema, (1 + step) / (10 + step)))
        log["train_loss"].append(round(loss.item(), 6))
        if val is not None and (step % cfg.val_every == 0 or step == cfg.steps - 1):
            vloss = _val_loss(shipped, val, cfg)
            model.train()
            log["val_loss"].append([step, round(vloss, 6)])
            bar.set_postfix(loss=f"{loss.item():.4f}", val=f"{vloss:.4f}")
        if cfg.stop_after_steps and step + 1 >= cfg.stop_after_steps:
            return True
        if cfg.max_minutes and time.perf_counter() - t0 > 60 * cfg.max_minutes:
            return True
    return False


def _plot_losses(path: Path, log: dict, model: str) -> None:
    steps_axis = list(range(len(log["train_loss"])))
    smooth = _ema(log["train_loss"], 0.95)
    series = {"train loss (EMA 0.95)": (steps_axis, smooth)}
    if log["val_loss"]:
        series["held-out loss"] = ([s for s, _ in log["val_loss"]], [v for _, v in log["val_loss"]])
    line_chart(
        path,
        series,
        title=f"physis-train {model}: velocity MSE",
        xlabel="step",
        ylabel="loss",
        markers=False,
    )


def _sha256(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _ema(values: list[float], decay: float) -> list[float]:
    out, acc = [], None
    for v in values:
        acc = v if acc is None else decay * acc + (1 - decay) * v
        out.append(acc)
    return out


FLAGS_USED_BY_LOSS = {
    f"--loss {name}": {"log_floor"} if name == "log_mse" else set() for name in LOSSES
}
NO_VAL = "a run without --val"
FLAGS_USED_BY_VAL = {"--val": {"val_every"}, NO_VAL: set()}
"""Flags only one loss, or a run with held-out bags, reads (refused by name elsewhere)."""


@cli_main("physis-train")
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="physis-train", description=__doc__.split("\n\n")[0])
    parser.add_argument("data", nargs="+", help="bags or folders of bags to train on")
    parser.add_argument("--out", required=True, type=Path, help="output folder")
    parser.add_argument(
        "--val", nargs="*", default=None, help="held-out bags for the validation loss"
    )
    defaults = TrainConfig()
    for name, val in asdict(defaults).items():
        parser.add_argument(
            f"--{name.replace('_', '-')}",
            type=finite_float if isinstance(val, float) else type(val),
            default=val,
            help=f"(default {val})",
        )
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    fields = {k: getattr(args, k) for k in asdict(defaults)}
    try:
        cfg = TrainConfig(**fields)
    except ValueError as err:
        parser.error(str(err))
    refuse_unused_flags(parser, args, f"--loss {cfg.loss}", FLAGS_USED_BY_LOSS)
    refuse_unused_flags(parser, args, "--val" if args.val else NO_VAL, FLAGS_USED_BY_VAL)
    log = train(cfg, args.data, args.out, val_paths=args.val, progress=not args.quiet)
    summary = {
        k: log[k]
        for k in (
            "steps_done",
            "stopped_early",
            "wall_s",
            "train_episodes",
            "train_frames",
            "final_train_loss_mean_last50",
            "final_val_loss",
        )
    }
    summary["weights"] = str(args.out / "weights.safetensors")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
