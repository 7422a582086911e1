"""``physis-train-wam``: a world-action model in one command, from a simulated task or bags.

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

With ``--bags BAGS --mapping FILE`` the episodes are a robot's rosbag2 bags instead, read
through the mapping file onto the contract of the task's model (``bag_mapping``,
``bag_episodes``; docs/train_on_bags.md); with ``--init`` a shipped model is fine-tuned on
them. Where the data comes from: ``physis_ros.train.wam_sources``.

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
import platform
import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from physis_ros.cli_errors import cli_main
from physis_ros.engine.build import build_model
from physis_ros.engine.config import get_preset
from physis_ros.engine.model import load_upstream_state_dict, to_upstream_state_dict
from physis_ros.engine.sampler import chunk_layout
from physis_ros.eval.plots import line_chart
from physis_ros.sim.tasks import TASKS
from physis_ros.train.train import SAVE_DTYPES, _ema, _ema_update, _lr_at, _sha256
from physis_ros.train.wam_config import WamTrainConfig, contract, metadata
from physis_ros.train.wam_data import WamWindows
from physis_ros.train.wam_loss import noise_levels, wam_loss, window_cond
from physis_ros.train.wam_sources import training_data


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


def _save(  # noqa: PLR0917 - one call site per use, all of them here
    model, cfg: WamTrainConfig, out: Path, steps_done, wall_s, windows, episodes, val
):
    """Round the weights to the saved dtype (in ``model``), write them with their metadata;
    returns the validation losses of exactly what was written (None without ``val``)."""
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


def train_wam(
    cfg: WamTrainConfig, out_dir: str | Path, *, data_dir: Path | None = None, progress=True
) -> dict:
    """Generate (or reuse, or read from bags) the episodes, train, write the weights and the
    log; returns it."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    mcfg = get_preset(cfg.model)
    cache = data_dir if data_dir is not None else out / "data"
    data = training_data(cfg, contract(cfg), cache, progress)
    windows, val = _windows(cfg, data)
    model = build_model(mcfg, seed=cfg.seed).train()
    if cfg.init:  # the same model (checked by the config): its weights as they are
        init = load_file(cfg.init, device="cpu")
        ours = to_upstream_state_dict(model)
        load_upstream_state_dict(model, {k: _widened(v.float(), ours[k]) for k, v in init.items()})
    shipped = copy.deepcopy(model).eval().requires_grad_(False) if cfg.ema else model
    log: dict = {"train_loss": [], "train_parts": [], "val": [], "config": asdict(cfg)}
    t0 = time.perf_counter()
    stopped_early = _fit(
        model,
        shipped,
        windows,
        val,
        cfg,
        log=log,
        out=out,
        episodes=len(data.train),
        progress=progress,
    )
    wall_s = time.perf_counter() - t0
    steps_done = len(log["train_loss"])
    final = _save(shipped, cfg, out, steps_done, wall_s, windows, len(data.train), val)
    log.update(
        steps_done=steps_done,
        stopped_early=stopped_early,
        wall_s=wall_s,
        train_episodes=len(data.train),
        train_frames=windows.total_frames,
        **data.log,
        platform=platform.platform(),
        final_train_loss_mean_last50=float(np.mean(log["train_loss"][-50:])),
        final_val=final,
    )
    (out / "train_log.json").write_text(json.dumps(log, indent=1) + "\n")
    _plot(out / "loss_curve.png", log, cfg.model)
    return log


def _windows(cfg: WamTrainConfig, data) -> tuple[WamWindows, tuple]:
    """The training windows of ``data`` (``wam_sources.TrainingData``), and the fixed
    validation batch."""
    mcfg = get_preset(cfg.model)
    common = dict(
        contract=contract(cfg),
        chunks=cfg.chunks,
        max_obs=cfg.max_obs,
        max_freeze_rows=cfg.max_freeze_rows,
    )
    windows = WamWindows(
        data.train,
        mcfg,
        seed=cfg.seed,
        hide_history_fraction=cfg.hide_history_fraction,
        start_fraction=cfg.start_fraction,
        committed_drift_rad=cfg.committed_drift_rad,
        **common,
    )
    val = _val_set(WamWindows(data.val, mcfg, seed=cfg.seed + 1, **common), cfg)
    return windows, val


def _fit(
    model,
    shipped,
    windows,
    val,
    cfg: WamTrainConfig,
    *,
    log: dict,
    out: Path,
    episodes: int,
    progress: bool,
) -> bool:
    """The optimizer steps (losses and validations into ``log``, checkpoints of a run on
    ``episodes`` training episodes into ``out``; ``shipped`` follows as the EMA); True when
    stopped before ``steps``."""
    # tqdm: an optional dependency (the ``eval`` extra), only for the progress bar

    mcfg, wam = model.cfg, contract(cfg)
    opt = torch.optim.AdamW(
        model.parameters(), lr=cfg.lr, betas=(0.9, 0.99), weight_decay=cfg.weight_decay
    )
    noise_gen = torch.Generator().manual_seed(cfg.seed + 1)
    levels = noise_levels(cfg.sample_steps, cfg.shift)
    denoised = chunk_layout(mcfg).denoised
    t0 = time.perf_counter()
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
            elapsed = time.perf_counter() - t0
            _save(copy.deepcopy(shipped), cfg, out, step + 1, elapsed, windows, episodes, None)
            # kept by step too: the next round's --init or --on-policy-from names one
            shutil.copyfile(out / "weights.safetensors", out / f"w{step + 1}.safetensors")
        if cfg.stop_after_steps and step + 1 >= cfg.stop_after_steps:
            return step + 1 < cfg.steps
        if cfg.max_minutes and time.perf_counter() - t0 > 60 * cfg.max_minutes:
            return True
    return False


def _plot(path: Path, log: dict, model: str) -> None:
    steps_axis = list(range(len(log["train_loss"])))
    vsteps = [v["step"] for v in log["val"]]
    line_chart(
        path,
        {
            "train loss (EMA 0.95)": (steps_axis, _ema(log["train_loss"], 0.95)),
            "validation loss": (vsteps, [v["loss"] for v in log["val"]]),
            "validation action part": (vsteps, [v["action"] for v in log["val"]]),
        },
        title=f"physis-train-wam {model}: velocity MSE",
        xlabel="step",
        ylabel="loss",
        markers=False,
    )


@cli_main("physis-train-wam")
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
    shown = {
        "task": f"push; one of {sorted(TASKS)}; with --bags, whose model's contract they feed",
        "model": "the task's: push-wam, reach-wam",
        "bags": "none: the task's expert episodes; else comma-separated rosbag2 bags or "
        "folders of bags, read through --mapping",
        "val_bags": "none: every 10th episode of --bags",
        "mapping": "none; the YAML file binding the bags' topics to the model's inputs "
        "(docs/train_on_bags.md)",
    }
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
