"""A world-action model's training data: any task's episodes in memory and training windows
cut from them.

What belongs here: generating (or loading the cached) expert episodes of a task
(``physis_ros.sim.episodes``), the contract a model of the task is trained with (its state
inputs and prompt), keeping the frames as the pixel codec's tokens and each frame's state as
the contract orders it (``WamContract``: by name, never by a task's own lists), and drawing
training windows on the live timeline: ``chunks`` consecutive chunks (slot c = frames
[s + cF, s + (c+1)F) and the joint-target rows from the slot's first frame on), the first
``n_obs`` of them observed. What the robot knows of the actions is a prefix of the timeline:
every row at or before the newest observed frame's time plus ``freeze`` rows (the rows it
executes while the answer is on its way) is known — clean and flagged, in observed and
generated chunks alike — and the rest is generated.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from physis_ros.contract.model import WamContract
from physis_ros.engine.codec import Codec
from physis_ros.engine.config import ModelConfig
from physis_ros.engine.sampler import _normalize, chunk_layout, chunk_numel, latent_to_tokens
from physis_ros.sim.base import CONTROL_HZ, FRAME_HZ, Episode, Task
from physis_ros.sim.episodes import load_episodes, run_expert_episode, save_episodes
from physis_ros.sim.tasks import get_task

ROWS_PER_FRAME = CONTROL_HZ // FRAME_HZ
DRIFT_REFERENCE_ROWS = 8
"""``committed_drift_rad`` is the drift's spread this many rows (0.4 s) past the newest frame."""
DATA_VERSION = 5
"""Bumped whenever a task, an expert, the perturbations or the episode file change: cached
episodes made by another version are not reused."""


def state_names(cfg: ModelConfig, task: Task | None = None) -> tuple[str, ...]:
    """The state inputs a preset is trained on: the first ``state_dim`` of its task's
    ``model_state`` (default: push's), except a ``-nowrench`` preset, which leaves out the
    wrench (the ablation of what it is worth)."""
    inputs = (task or get_task("push")).model_state
    if cfg.name.endswith("-nowrench"):
        inputs = tuple(s for s in inputs if s.source != "wrench")
    return tuple(s.name for s in inputs[: cfg.state_dim])


def wam_contract(
    cfg: ModelConfig,
    task: Task,
    *,
    prompted: bool = True,
    min_committed_ms: float = 0.0,
    max_known_rows_ahead: int = 8,
) -> WamContract:
    """The contract of preset ``cfg`` trained on ``task``: its state inputs (``state_names``),
    the task's prompt if ``prompted``, its chunk and camera; ValueError when the preset's
    actions or state do not fit the task."""
    if cfg.action_dim != len(task.joint_names) or cfg.state_dim > len(state_names(cfg, task)):
        raise ValueError(
            f"model {cfg.name!r} (action_dim {cfg.action_dim}, state_dim {cfg.state_dim}) does "
            f"not fit task {task.name!r} ({len(task.joint_names)} joints, "
            f"{len(task.model_state)} state inputs)"
        )
    return task.contract(
        state_names=state_names(cfg, task),
        prompted=prompted,
        rows_per_chunk=cfg.action_horizon,
        frames_per_chunk=cfg.frames_per_chunk,
        image_size=cfg.image_size,
        min_committed_ms=min_committed_ms,
        max_known_rows_ahead=max_known_rows_ahead,
    )


def episodes_for(
    seeds: list[int],
    *,
    perturb: bool,
    cache_dir: Path | None,
    progress: bool = True,
    task: str = "push",
) -> list[Episode]:
    """Expert episodes of ``task`` for ``seeds`` (cached as one .npz per task and seed list
    under ``cache_dir``)."""
    # tqdm: an optional dependency (the ``eval`` extra), only for the progress bar

    sim_task = get_task(task)
    key_src = [DATA_VERSION, task, seeds, perturb]
    key = hashlib.sha256(json.dumps(key_src).encode()).hexdigest()[:12]
    path = None if cache_dir is None else Path(cache_dir) / f"episodes_{key}.npz"
    return cached_episodes(
        path,
        lambda: [
            run_expert_episode(sim_task.sample(seed), perturb=perturb)
            for seed in tqdm(seeds, desc="expert episodes", unit="ep", disable=not progress)
        ],
    )


def cached_episodes(path: Path | None, make) -> list[Episode]:
    """The episodes saved at ``path``, else ``make()``'s, saved there (None: not cached)."""
    if path is not None and path.exists():
        return load_episodes(path)
    episodes = make()
    if path is not None:  # written whole, then renamed: a concurrent run never reads half
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.stem}.{os.getpid()}.partial.npz")
        save_episodes(partial, episodes)
        partial.replace(path)
    return episodes


@dataclass
class _Episode:
    latents: np.ndarray
    """[N, C, h, w] uint8: frame n's latent (the pixel codec is exact: (latent + 1) * 127.5)."""
    state: np.ndarray
    """[N, S] float32 normalised state values."""
    rows: np.ndarray
    """[M, A] float32 normalised joint-target rows."""
    perturbed: np.ndarray
    """[M] bool."""
    prompt_values: np.ndarray
    """[P] float32 the task values the contract's prompt is made of."""


@dataclass
class WamBatch:
    x0: torch.Tensor
    """[B, C, X] clean packed chunks (unknown rows hold their true values, flags set)."""
    n_obs: torch.Tensor
    """[B] observed chunks at the start of each window."""
    known: torch.Tensor
    """[B, C, H] bool: rows known to the robot (conditioning, not trained)."""
    trained_rows: torch.Tensor
    """[B, C, H] bool: generated rows whose action error counts (not known, not perturbed)."""
    trained_chunks: torch.Tensor
    """[B, C] bool: generated chunks whose video and state error count (no unknown
    perturbed row in the chunk's own period: the model never learns to produce those)."""
    prompt_values: torch.Tensor
    """[B, P] each window's task values of the contract's prompt (push: its goal, table frame,
    m): its stream's prompt."""


class WamWindows:
    """Draws training windows [B, C, X] from episodes, reproducibly from a seed; each frame's
    state and each window's prompt as ``contract`` says (default: the episodes' task's, for
    ``cfg``, prompted)."""

    def __init__(
        self,
        episodes: list[Episode],
        cfg: ModelConfig,
        *,
        contract: WamContract | None = None,
        chunks: int,
        max_obs: int,
        max_freeze_rows: int,
        seed: int,
        per_slot_fraction: float = 0.5,
        hide_history_fraction: float = 0.0,
        start_fraction: float = 0.0,
        committed_drift_rad: float = 0.0,
        committed_drift_fraction: float = 0.5,
    ) -> None:
        if cfg.codec != "pixel" or cfg.codec_stride[0] != 1:
            raise ValueError("world-action training keeps each frame's pixel-codec latent")
        if contract is None and episodes:
            contract = wam_contract(cfg, get_task(episodes[0].task))
        self.cfg, self.contract = cfg, contract
        self.chunks, self.max_obs, self.max_freeze_rows = chunks, max_obs, max_freeze_rows
        self.per_slot_fraction = per_slot_fraction
        self.hide_history_fraction = hide_history_fraction
        self.start_fraction = start_fraction
        self.committed_drift_fraction = committed_drift_fraction
        # per row after the newest frame, in normalised units per joint
        self.drift_per_row = (
            committed_drift_rad / DRIFT_REFERENCE_ROWS / np.asarray(cfg.action_scale, np.float32)
        )
        self.frames = cfg.frames_per_chunk
        codec = Codec(cfg)
        self.episodes = []
        for ep in episodes:
            if len(ep.frames) < chunks * self.frames:
                continue
            latent = codec.encode_frames(ep.frames)  # [C, N, h, w]
            latents = ((latent.permute(1, 0, 2, 3) + 1.0) * 127.5).round().to(torch.uint8)
            state = _normalize(
                torch.from_numpy(contract_state(contract, ep)), cfg.state_center, cfg.state_scale
            )
            rows = _normalize(torch.from_numpy(ep.rows), cfg.action_center, cfg.action_scale)
            prompt = [ep.task_values[name] for name in contract.prompt.values]
            self.episodes.append(
                _Episode(
                    latents.numpy(),
                    state.numpy(),
                    rows.numpy(),
                    ep.perturbed.copy(),
                    np.asarray(prompt, np.float32),
                )
            )
        if not self.episodes:
            raise ValueError(f"no episode has the {chunks * self.frames} frames a window needs")
        starts = np.array([len(e.latents) - chunks * self.frames + 1 for e in self.episodes], float)
        self.weights = starts / starts.sum()
        self.rng = np.random.default_rng(seed)
        # its own stream: drifting or not draws the same windows
        self.drift_rng = np.random.default_rng([seed, 0xD21F7])

    @property
    def total_frames(self) -> int:
        return sum(len(e.latents) for e in self.episodes)

    def batch(self, size: int) -> WamBatch:
        cfg, c_n, f = self.cfg, self.chunks, self.frames
        h = cfg.action_horizon
        lay = chunk_layout(cfg)
        x0 = torch.zeros(size, c_n, chunk_numel(cfg))
        n_obs = torch.zeros(size, dtype=torch.long)
        known = torch.zeros(size, c_n, h, dtype=torch.bool)
        trained_rows = torch.zeros(size, c_n, h, dtype=torch.bool)
        trained_chunks = torch.zeros(size, c_n, dtype=torch.bool)
        prompt_values = torch.zeros(size, len(self.contract.prompt.values))
        for b, i in enumerate(self.rng.choice(len(self.episodes), size=size, p=self.weights)):
            ep = self.episodes[i]
            prompt_values[b] = torch.from_numpy(ep.prompt_values)
            start = int(self.rng.integers(0, len(ep.latents) - c_n * f + 1))
            # some windows open the episode: the first plan (from the arm at rest, where only
            # the scene and the task say which way to go) decides the episode, yet a window
            # drawn anywhere covers it rarely
            if self.start_fraction and self.rng.random() < self.start_fraction:
                start = 0
            obs = int(self.rng.integers(1, self.max_obs + 1))
            freeze = int(self.rng.integers(0, self.max_freeze_rows + 1))
            n_obs[b] = obs
            last_known = ROWS_PER_FRAME * (start + obs * f - 1) + freeze
            # half the windows: each observed chunk knows its rows as of its own last frame
            # (a live stream takes each observed slot once, when it completes)
            per_slot = bool(self.rng.random() < self.per_slot_fraction)
            # some windows hide every row at or before the newest frame (only the committed
            # rows after it stay known): the next rows cannot be extrapolated from the rows
            # before, so they have to come from the frames and the state (a model always
            # shown them learned to continue them and ignored the camera)
            hidden_until = -1
            newest_row = ROWS_PER_FRAME * (start + obs * f - 1)
            if self.rng.random() < self.hide_history_fraction:
                hidden_until = newest_row
            drift = self._committed_drift(freeze)
            for c in range(c_n):
                first = start + c * f
                horizon = last_known
                if per_slot and c < obs:
                    horizon = ROWS_PER_FRAME * (first + f - 1) + freeze
                latent = torch.from_numpy(ep.latents[first : first + f]).float() / 127.5 - 1
                video = latent_to_tokens(cfg, latent.permute(1, 0, 2, 3)).reshape(-1)
                row_t = ROWS_PER_FRAME * first + np.arange(h)
                idx = np.minimum(row_t, len(ep.rows) - 1)
                is_known = (row_t <= horizon) & (row_t > hidden_until)
                pert = ep.perturbed[idx] & (row_t < len(ep.rows))
                x0[b, c, lay.video] = video
                rows = ep.rows[idx]
                if drift is not None:
                    ahead = np.where(is_known, np.maximum(row_t - newest_row, 0), 0)
                    rows = rows + ahead[:, None] * drift
                x0[b, c, lay.actions] = torch.from_numpy(rows.reshape(-1).astype(np.float32))
                x0[b, c, lay.state] = torch.from_numpy(ep.state[first : first + f].reshape(-1))
                x0[b, c, lay.known] = torch.from_numpy(is_known.astype(np.float32))
                known[b, c] = torch.from_numpy(is_known)
                if c >= obs:
                    trained_rows[b, c] = torch.from_numpy(~is_known & ~pert)
                    own = slice(0, ROWS_PER_FRAME * f)
                    trained_chunks[b, c] = not bool((pert & ~is_known)[own].any())
        return WamBatch(x0, n_obs, known, trained_rows, trained_chunks, prompt_values)

    def _committed_drift(self, freeze: int) -> np.ndarray | None:
        """[action_dim] per-row drift of the committed rows (after the newest frame), or None.

        Served, the committed rows are the model's own earlier plan, not the expert's: a
        model only ever shown the expert's committed rows learns to continue them, and in the
        loop continues its own mistakes (told them, the shipped dg2 lost 8 of 60 episodes at
        150 ms). Drifted committed rows with the expert's rows still the targets after them
        teach it to correct what it is told rather than copy it. The drift grows linearly
        from the newest frame (the robot is where the frames show it), by a normal draw per
        joint with ``committed_drift_rad`` its spread DRIFT_REFERENCE_ROWS rows ahead."""
        if freeze == 0 or not self.drift_per_row.any():
            return None
        if self.drift_rng.random() >= self.committed_drift_fraction:
            return None
        draw = self.drift_rng.standard_normal(len(self.drift_per_row))
        return (draw * self.drift_per_row).astype(np.float32)


def contract_state(contract: WamContract, episode: Episode) -> np.ndarray:
    """[N, S] float32: each frame's state inputs in the contract's order, by name: a task
    input from the episode's task values (the same in every frame), the others from its state
    columns."""
    n = len(episode.frames)
    columns = [
        np.full(n, episode.task_values[s.key], np.float32)
        if s.source == "task"
        else episode.values([s.name])[:, 0].astype(np.float32)
        for s in contract.state
    ]
    return np.stack(columns, axis=1) if columns else np.zeros((n, 0), np.float32)
