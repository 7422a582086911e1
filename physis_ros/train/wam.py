"""``physis-train-wam``: a simulated task's world-action model, from nothing, in one command.

``--task`` names the task (``physis_ros.sim.tasks``: ``push``, the default, trains push-wam;
``reach`` trains reach-wam; ``--model`` another preset that fits it). It runs the task's
scripted expert (train seeds 0..N-1 with perturbations and recoveries, validation seeds from
20000), then trains with the noisy-history recipe on the
live timeline (DESIGN.md §3): a window of ``chunks`` chunks whose first 1..``max_obs`` are
observed (clean: frames, state, the actions the robot reported), the rest generated at one
noise level shared by the window (the levels of the served sampler). The robot's known
actions are a prefix of the timeline: every row up to the newest observed frame plus
0..``max_freeze_rows`` rows (what it executes while the answer is on its way) enters clean
and flagged; the model learns frames, the remaining action rows and the state together. In a
share of the windows (``hide_history_fraction``) the rows up to the newest frame are hidden,
so that the actions come from the camera and the state, not from continuing those rows.
Loss: velocity MSE of video, action rows and state values, each a mean over what counts
(rows commanded by a perturbation are never trained on).

With ``--on-policy-from CHECKPOINTS --on-policy-episodes N`` (a DAgger round), each checkpoint
first drives N more training episodes in the closed loop while the expert takes over now and
then (``wam_onpolicy``): the expert's rows from the states the model's own actions led to
join the training data, the model's rows as known history only.

Writes ``weights.safetensors`` (fp16, with the metadata the engine and the eval read, the
model's contract among it: ``physis_ros.contract.model``),
``train_log.json`` and ``loss_curve.png`` into ``--out``. Reproducible from ``--seed`` on one
CPU thread. The engine-side layout is ``physis_ros.engine.sampler``; the data
``physis_ros.train.wam_data``; the loss ``physis_ros.train.wam_loss``.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import platform
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from physis_ros.contract.model import CONTRACT_KEY, WamContract
from physis_ros.engine.build import build_model
from physis_ros.engine.config import get_preset
from physis_ros.engine.model import load_upstream_state_dict, to_upstream_state_dict
from physis_ros.engine.sampler import chunk_layout
from physis_ros.eval.closed_loop import ClosedLoopConfig
from physis_ros.sim.base import CONTROL_HZ, FRAME_HZ
from physis_ros.sim.tasks import TASKS, get_task
from physis_ros.train.train import SAVE_DTYPES, _ema, _ema_update, _lr_at, _sha256
from physis_ros.train.wam_data import WamWindows, episodes_for, wam_contract
from physis_ros.train.wam_loss import noise_levels, wam_loss, window_cond
from physis_ros.train.wam_onpolicy import on_policy_episodes

VAL_SEED0 = 20_000
"""Validation episodes' seeds start here; held-out evaluation uses 10000.. (physis-eval)."""
HELD_OUT_SEED0 = ClosedLoopConfig().seed0
"""physis-eval --closed-loop's episodes start here: no training episode may use them."""


GOAL_PROMPT = "goal_xy"
"""The ``prompt`` value of a run conditioned on its task's values (its contract's
``task_features`` prompt); the name is the one every run has written."""


@dataclass(frozen=True, kw_only=True)
class WamTrainConfig:
    """Everything that determines the trained weights."""

    task: str = "push"
    """The simulated task trained on (``physis_ros.sim.tasks``)."""
    model: str = ""
    """Preset (default: the task's: ``push-wam``, ``reach-wam``; or ``push-wam-nowrench``:
    push-wam without the wrench)."""
    episodes: int = 1000
    """Training episodes (expert, with perturbations), seeds 0..episodes-1."""
    val_episodes: int = 40
    steps: int = 3000
    batch_size: int = 16
    chunks: int = 4
    """Chunks per window: 1..max_obs observed, the rest generated."""
    max_obs: int = 3
    window: int = 3
    """W: previous chunks each chunk attends to (the served window)."""
    max_freeze_rows: int = 8
    """Rows after the newest observed frame that may be known (0.4 s at 20 Hz)."""
    hide_history_fraction: float = 0.5
    """Training windows (not validation, kept comparable with earlier runs) whose rows at or
    before the newest observed frame are hidden, so the actions must come from the frames and
    the state. Served requests hide them always (``contract.timeline.known_rows``): the
    shipped push-wam was trained at 0.5, and served at 1.0 it reached 11 of 20 held-out
    episodes against 3."""
    start_fraction: float = 0.0
    """Training windows that open their episode (the first plan, from the arm at rest)."""
    committed_drift_rad: float = 0.0
    """In half the training windows with committed rows, those rows drift off the expert's
    (spread in rad 0.4 s past the newest frame; ``WamWindows._committed_drift``) while the
    targets after them stay the expert's: served, the committed rows are the model's own
    plan, and a model that copies them continues its mistakes. 0: the expert's rows."""
    min_committed_ms: float = 0.0
    """Written into the weights' metadata: served requests (and physis-eval's closed loop)
    commit the robot's plan at least this long after the newest frame (``weights.
    min_committed_ms``). Choose it from a closed-loop evaluation (``physis-eval --closed-loop
    --min-committed-ms``); 0: only what the response latency commits."""
    shift: float = 3.0
    sample_steps: int = 4
    """Noise levels of the K-step sampler (this shift) the windows are trained at."""
    action_weight: float = 2.0
    state_weight: float = 0.5
    lr: float = 3e-3
    warmup_steps: int = 50
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    ema: float = 0.999
    save_dtype: str = "float16"
    init: str = ""
    """Start from these weights (a physis-train-wam checkpoint of the same model: to train
    on from a run's last checkpoint with a new schedule) instead of the seeded ones."""
    prompt: str = GOAL_PROMPT
    """``goal_xy``: each window's stream is conditioned on its task values as the task's
    prompt says (push: its goal; ``contract.model.prompt_features``), as the served streams
    are; "": on the fixed stand-in prompt (the goal only in the camera and the state)."""
    on_policy_from: str = ""
    """Comma-separated checkpoints of the model: each drives ``on_policy_episodes`` training
    episodes in the closed loop with expert takeovers (``wam_onpolicy``; cached), added to
    the expert's episodes (DAgger: list every earlier round's checkpoint to aggregate)."""
    on_policy_episodes: int = 0
    seed: int = 0
    threads: int = 1
    """Torch threads for training, and worker processes for the on-policy episodes."""
    val_every: int = 100
    checkpoint_every: int = 250
    """Write the weights so far (``weights.safetensors``, and kept as ``w<steps>.safetensors``)
    every this many steps (0: only at the end): a long run can be evaluated, or stopped,
    midway."""
    max_minutes: float = 0.0
    """0: no limit; otherwise stop after this many minutes of training."""
    stop_after_steps: int = 0
    """0: run all ``steps``; else stop after this many with the learning-rate schedule of
    ``steps``: reproduces exactly the checkpoint a longer run wrote at that step."""

    @property
    def on_policy_checkpoints(self) -> list[str]:
        return [p for p in self.on_policy_from.split(",") if p]

    def __post_init__(self) -> None:
        if self.task in TASKS and not self.model:  # frozen: the default resolved once
            object.__setattr__(self, "model", get_task(self.task).default_model)
        checks = {
            "task": self.task in TASKS,
            "episodes": self.episodes >= 1,
            "val_episodes": self.val_episodes >= 1,
            "steps": self.steps >= 1,
            "batch_size": self.batch_size >= 1,
            "chunks": self.chunks >= 2,
            "max_obs": 1 <= self.max_obs < self.chunks,
            "window": self.window >= self.max_obs,
            "max_freeze_rows": self.max_freeze_rows >= 0,
            "hide_history_fraction": 0 <= self.hide_history_fraction <= 1,
            "start_fraction": 0 <= self.start_fraction <= 1,
            "committed_drift_rad": self.committed_drift_rad >= 0,
            "min_committed_ms": math.isfinite(self.min_committed_ms) and self.min_committed_ms >= 0,
            "shift": self.shift > 0,
            "sample_steps": self.sample_steps >= 1,
            "action_weight": self.action_weight >= 0,
            "state_weight": self.state_weight >= 0,
            "lr": self.lr > 0,
            "ema": 0 <= self.ema < 1,
            "save_dtype": self.save_dtype in SAVE_DTYPES,
            "threads": self.threads >= 1,
            "val_every": self.val_every >= 1,
            "checkpoint_every": self.checkpoint_every >= 0,
            "max_minutes": self.max_minutes >= 0,
            "stop_after_steps": 0 <= self.stop_after_steps <= self.steps,
            "prompt": self.prompt in ("", GOAL_PROMPT),
            "on_policy_episodes": self.on_policy_episodes >= 0
            and (self.on_policy_episodes > 0) == bool(self.on_policy_from)
            and len(self.on_policy_checkpoints) * self.on_policy_episodes <= HELD_OUT_SEED0,
        }
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"{name} has an invalid value: {getattr(self, name)!r}")
        cfg = get_preset(self.model)
        if not (cfg.action_mode == "predict" and cfg.committed_actions and cfg.state_dim):
            raise ValueError(f"model {self.model!r} is not a world-action model with state")
        wam_contract(cfg, get_task(self.task))  # the preset fits the task
        if self.episodes + self.val_episodes > VAL_SEED0:
            raise ValueError(f"training seeds would reach the validation seeds ({VAL_SEED0}..)")
        for path in self.on_policy_checkpoints:
            if not Path(path).is_file():
                raise ValueError(f"on_policy_from: {path} is not a file")
        if self.init:
            from physis_ros.contract.safetensors import read_metadata

            if not Path(self.init).is_file():
                raise ValueError(f"init {self.init} is not a file")
            trained_as = read_metadata(self.init).get("model")
            if trained_as != self.model:
                raise ValueError(f"init {self.init} holds model {trained_as!r}, not {self.model!r}")


def _widened(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """``old`` inside ``new``'s shape, zeros around it: a checkpoint trained with fewer state
    columns (before the goal's) starts the wider model exactly where it was."""
    if old.shape == new.shape:
        return old
    if old.dim() != new.dim() or any(o > n for o, n in zip(old.shape, new.shape, strict=True)):
        raise ValueError(f"init weights of shape {tuple(old.shape)} do not fit {tuple(new.shape)}")
    out = torch.zeros_like(new)
    out[tuple(slice(0, n) for n in old.shape)] = old
    return out


def contract(cfg: WamTrainConfig) -> WamContract:
    """The contract the model ``cfg`` trains is trained with (written into its weights)."""
    return wam_contract(
        get_preset(cfg.model),
        get_task(cfg.task),
        prompted=bool(cfg.prompt),
        min_committed_ms=cfg.min_committed_ms,
        max_known_rows_ahead=cfg.max_freeze_rows,
    )


@torch.no_grad()
def _validate(model, val: tuple, cfg: WamTrainConfig) -> dict[str, float]:
    model.eval()
    batch, sigma, eps = val
    cond = window_cond(model.cfg, contract(cfg).prompt, batch.prompt_values)
    loss, parts = wam_loss(
        model,
        batch,
        sigma=sigma,
        eps=eps,
        cond=cond,
        window=cfg.window,
        action_weight=cfg.action_weight,
        state_weight=cfg.state_weight,
    )
    return {"loss": loss.item(), **parts}


def _val_set(windows: WamWindows, cfg: WamTrainConfig, size: int = 48) -> tuple:
    """A fixed validation batch: every sampler level equally often, fixed noise."""
    gen = torch.Generator().manual_seed(cfg.seed + 99)
    batch = windows.batch(size)
    levels = noise_levels(cfg.sample_steps, cfg.shift)
    sigma = levels[torch.arange(size) % len(levels)]
    eps = torch.randn(size, cfg.chunks, chunk_layout(windows.cfg).denoised, generator=gen)
    return batch, sigma, eps


def metadata(cfg: WamTrainConfig, extra: dict[str, str]) -> dict[str, str]:
    """What the engine, the server and physis-eval read from the weights."""
    mcfg = get_preset(cfg.model)
    wam = contract(cfg)
    return {
        "format": "physis_ros world-action model",
        "model": cfg.model,
        "window": str(cfg.window),
        "steps": str(cfg.sample_steps),
        "frame_hz": str(float(FRAME_HZ)),
        "action_hz": str(float(CONTROL_HZ)),
        "image_size": f"{mcfg.image_size[0]}x{mcfg.image_size[1]}",
        "frames_per_chunk": str(mcfg.frames_per_chunk),
        "action_names": ",".join(wam.action_names),
        "state_names": ",".join(wam.state_names),
        "task": cfg.task,
        CONTRACT_KEY: wam.to_json(),
        "context_noise": "clean",
        "horizon": "1",
        "max_known_rows_ahead": str(cfg.max_freeze_rows),
        "min_committed_ms": str(float(cfg.min_committed_ms)),
        **({"prompt": cfg.prompt} if cfg.prompt else {"cond_seed": "0"}),
        "train_config": json.dumps(asdict(cfg)),
        "torch": torch.__version__,
        **extra,
    }


def _save(  # noqa: PLR0917 - one call site per use, all of them here
    model, cfg: WamTrainConfig, out: Path, steps_done, wall_s, windows, episodes, val
):
    """Round the weights to the saved dtype (in ``model``), write them with their metadata;
    returns the validation losses of exactly what was written (None without ``val``)."""
    from safetensors.torch import save_file

    dtype = SAVE_DTYPES[cfg.save_dtype]
    state = {k: v.to(dtype) for k, v in to_upstream_state_dict(model).items()}
    load_upstream_state_dict(model, state)
    meta = metadata(
        cfg,
        {
            "steps_done": str(steps_done),
            "train_wall_s": f"{wall_s:.1f}",
            "train_frames": str(windows.total_frames),
            "train_episodes": str(episodes),
            **({"init_sha256": _sha256(cfg.init)} if cfg.init else {}),
        },
    )
    save_file(state, str(out / "weights.safetensors"), metadata=meta)
    return _validate(model, val, cfg) if val is not None else None


def _episodes(cfg: WamTrainConfig, cache: Path, progress: bool) -> tuple[list, list]:
    """The training episodes (the expert's, then each on-policy round's) and the validation
    episodes of the task, generated or taken from ``cache``."""
    train_eps = episodes_for(
        list(range(cfg.episodes)), perturb=True, cache_dir=cache, task=cfg.task
    )
    n_on = cfg.on_policy_episodes
    for r, checkpoint in enumerate(cfg.on_policy_checkpoints):  # round r: seeds of its own
        seeds = list(range(r * n_on, (r + 1) * n_on))
        train_eps += on_policy_episodes(
            checkpoint, seeds, cache_dir=cache, progress=progress, workers=cfg.threads
        )
    val_seeds = list(range(VAL_SEED0, VAL_SEED0 + cfg.val_episodes))
    val_eps = episodes_for(
        val_seeds, perturb=True, cache_dir=cache, progress=progress, task=cfg.task
    )
    return train_eps, val_eps


def train_wam(
    cfg: WamTrainConfig, out_dir: str | Path, *, data_dir: Path | None = None, progress=True
) -> dict:
    """Generate (or reuse) the episodes, train, write the weights and the log; returns it."""
    from tqdm import tqdm

    from physis_ros.eval.plots import line_chart

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    mcfg = get_preset(cfg.model)
    wam = contract(cfg)
    cache = data_dir if data_dir is not None else out / "data"
    train_eps, val_eps = _episodes(cfg, cache, progress)
    common = dict(
        contract=wam,
        chunks=cfg.chunks,
        max_obs=cfg.max_obs,
        max_freeze_rows=cfg.max_freeze_rows,
    )
    windows = WamWindows(
        train_eps,
        mcfg,
        seed=cfg.seed,
        hide_history_fraction=cfg.hide_history_fraction,
        start_fraction=cfg.start_fraction,
        committed_drift_rad=cfg.committed_drift_rad,
        **common,
    )
    val = _val_set(WamWindows(val_eps, mcfg, seed=cfg.seed + 1, **common), cfg)
    model = build_model(mcfg, seed=cfg.seed).train()
    if cfg.init:  # the same model (checked by the config): its weights as they are
        from safetensors.torch import load_file

        init = load_file(cfg.init, device="cpu")
        ours = to_upstream_state_dict(model)
        load_upstream_state_dict(model, {k: _widened(v.float(), ours[k]) for k, v in init.items()})
    shipped = copy.deepcopy(model).eval().requires_grad_(False) if cfg.ema else model
    opt = torch.optim.AdamW(
        model.parameters(), lr=cfg.lr, betas=(0.9, 0.99), weight_decay=cfg.weight_decay
    )
    noise_gen = torch.Generator().manual_seed(cfg.seed + 1)
    levels = noise_levels(cfg.sample_steps, cfg.shift)
    denoised = chunk_layout(mcfg).denoised
    log: dict = {"train_loss": [], "train_parts": [], "val": [], "config": asdict(cfg)}
    t0 = time.perf_counter()
    stopped_early = False
    bar = tqdm(range(cfg.steps), desc=f"train {cfg.model}", unit="step", disable=not progress)
    for step in bar:
        batch = windows.batch(cfg.batch_size)
        sigma = levels[torch.randint(0, len(levels), (cfg.batch_size,), generator=noise_gen)]
        eps = torch.randn(cfg.batch_size, cfg.chunks, denoised, generator=noise_gen)
        for group in opt.param_groups:
            group["lr"] = _lr_at(step, cfg)
        loss, parts = wam_loss(
            model,
            batch,
            sigma=sigma,
            eps=eps,
            cond=window_cond(mcfg, wam.prompt, batch.prompt_values),
            window=cfg.window,
            action_weight=cfg.action_weight,
            state_weight=cfg.state_weight,
        )
        if not torch.isfinite(loss):
            raise FloatingPointError(f"loss is {loss.item()} at step {step}; lower --lr")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        if cfg.ema:
            _ema_update(shipped, model, min(cfg.ema, (1 + step) / (10 + step)))
        log["train_loss"].append(round(loss.item(), 6))
        log["train_parts"].append({k: round(v, 6) for k, v in parts.items()})
        if step % cfg.val_every == 0 or step == cfg.steps - 1:
            vals = _validate(shipped, val, cfg)
            model.train()
            log["val"].append({"step": step, **{k: round(v, 6) for k, v in vals.items()}})
            bar.set_postfix(
                loss=f"{loss.item():.4f}", val=f"{vals['loss']:.4f}", act=f"{vals['action']:.4f}"
            )
        if cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0:
            ema_copy = copy.deepcopy(shipped)
            elapsed = time.perf_counter() - t0
            _save(ema_copy, cfg, out, step + 1, elapsed, windows, len(train_eps), None)
            # kept by step too: the next round's --init or --on-policy-from names one
            shutil.copyfile(out / "weights.safetensors", out / f"w{step + 1}.safetensors")
        if cfg.stop_after_steps and step + 1 >= cfg.stop_after_steps:
            stopped_early = step + 1 < cfg.steps
            break
        if cfg.max_minutes and time.perf_counter() - t0 > 60 * cfg.max_minutes:
            stopped_early = True
            break
    wall_s = time.perf_counter() - t0
    steps_done = len(log["train_loss"])
    final = _save(shipped, cfg, out, steps_done, wall_s, windows, len(train_eps), val)
    log.update(
        steps_done=steps_done,
        stopped_early=stopped_early,
        wall_s=wall_s,
        train_episodes=len(train_eps),
        train_frames=windows.total_frames,
        expert_success_train=float(np.mean([ep.reached_s is not None for ep in train_eps])),
        platform=platform.platform(),
        final_train_loss_mean_last50=float(np.mean(log["train_loss"][-50:])),
        final_val=final,
    )
    (out / "train_log.json").write_text(json.dumps(log, indent=1) + "\n")
    steps_axis = list(range(steps_done))
    vsteps = [v["step"] for v in log["val"]]
    line_chart(
        out / "loss_curve.png",
        {
            "train loss (EMA 0.95)": (steps_axis, _ema(log["train_loss"], 0.95)),
            "validation loss": (vsteps, [v["loss"] for v in log["val"]]),
            "validation action part": (vsteps, [v["action"] for v in log["val"]]),
        },
        title=f"physis-train-wam {cfg.model}: velocity MSE",
        xlabel="step",
        ylabel="loss",
        markers=False,
    )
    return log


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="physis-train-wam", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="output folder")
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help="where the generated episodes are cached (default OUT/data)",
    )
    defaults = asdict(WamTrainConfig()) | {"model": ""}  # "": the task's model
    shown = {"task": f"push; one of {sorted(TASKS)}", "model": "the task's: push-wam, reach-wam"}
    for name, val in defaults.items():
        parser.add_argument(
            f"--{name.replace('_', '-')}",
            type=type(val),
            default=val,
            help=f"(default {shown.get(name, val)})",
        )
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    try:
        cfg = WamTrainConfig(**{k: getattr(args, k) for k in defaults})
    except ValueError as err:
        parser.error(str(err))
    log = train_wam(cfg, args.out, data_dir=args.data_dir, progress=not args.quiet)
    keys = ("steps_done", "stopped_early", "wall_s", "train_episodes", "train_frames")
    summary = {k: log[k] for k in keys}
    summary.update(final_val=log["final_val"], weights=str(args.out / "weights.safetensors"))
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
