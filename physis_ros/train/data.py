"""Training data: recorded episodes in memory, and sequences of chunks sampled from them.

What belongs here: loading bags (through ``physis_ros.eval.bag``, the same reader and the same
action alignment that evaluation uses; with a mapping file, its camera and command topics and
its joints in the action order: ``physis_ros.train.bag_mapping``), and drawing training
sequences — ``chunks`` chunks of
``frames_per_chunk`` frames each, with each chunk's commanded actions — packed into the
engine's chunk layout by the engine's own codec. Sampling is reproducible from a seed.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from physis_ros.engine.codec import Codec
from physis_ros.engine.config import ModelConfig
from physis_ros.engine.sampler import pack_chunk
from physis_ros.eval.bag import BagReadError, Episode, TopicChoice, read_episode
from physis_ros.train.bag_mapping import BagMapping


@dataclass
class Dataset:
    """Episodes at the model's image size and frame rate."""

    episodes: list[Episode]
    skipped: list[str]
    """Bags not used, with the reason."""
    skipped_messages: Counter = field(default_factory=Counter)
    """(topic, reason) -> messages of the used bags that could not be used."""

    @property
    def frames(self) -> int:
        return sum(len(ep.frames) for ep in self.episodes)


def find_bags(paths: list[str | Path]) -> list[Path]:
    """Bag directories (holding metadata.yaml) given directly or found under the paths."""
    found: list[Path] = []
    for p in map(Path, paths):
        if (p / "metadata.yaml").exists() or p.suffix in (".mcap", ".db3"):
            found.append(p)
        elif p.is_dir():
            found.extend(sorted(m.parent for m in p.rglob("metadata.yaml")))
        else:
            raise FileNotFoundError(f"{p} is neither a bag nor a folder of bags")
    return found


def load_dataset(
    paths: list[str | Path],
    cfg: ModelConfig,
    *,
    frame_hz: float,
    progress: bool = True,
    mapping: BagMapping | None = None,
) -> Dataset:
    """Read every bag under ``paths`` at the model's image size, subsampled to ``frame_hz``
    (with ``mapping``: its camera and command topics, the commands in its joints' order)."""
    # tqdm: an optional dependency (the ``eval`` extra), only for the progress bar

    height, width = cfg.image_size
    topics = TopicChoice()
    if mapping is not None:
        topics = TopicChoice(image=mapping.camera, command=mapping.command.topic)
    episodes, skipped, messages = [], [], Counter()
    for bag in tqdm(find_bags(paths), desc="loading bags", unit="bag", disable=not progress):
        try:
            ep = read_episode(bag, topics=topics, image_size=(height, width), require_commands=True)
            if mapping is not None:
                ep = _in_action_order(ep, mapping.command.joints)
        except BagReadError as err:
            skipped.append(str(err))
            continue
        messages.update(ep.skipped)
        stride = max(1, round(ep.frame_hz / frame_hz)) if ep.frame_hz > 0 else 1
        ep = ep.subsample(stride)
        if abs(ep.frame_hz - frame_hz) > 0.1 * frame_hz:
            skipped.append(
                f"{bag}: camera at {ep.frame_hz:.2f} Hz cannot be brought to {frame_hz} Hz"
            )
            continue
        if len(ep.commands) and ep.commands.shape[1] != cfg.action_dim:
            skipped.append(
                f"{bag}: {ep.commands.shape[1]} joints, the model takes {cfg.action_dim}"
            )
            continue
        episodes.append(ep)
    if not episodes:
        raise ValueError(f"no usable episode under {[str(p) for p in paths]}: {skipped}")
    return Dataset(episodes, skipped, messages)


def _in_action_order(ep: Episode, joints: tuple[str, ...]) -> Episode:
    """``ep`` with its commands' columns those of ``joints``, in that order; BagReadError
    naming a joint the commands do not have."""
    missing = [j for j in joints if j not in ep.joint_names]
    if missing:
        raise BagReadError(
            f"{ep.path}: the commands on {ep.command_topic} have joints {list(ep.joint_names)}, "
            f"not {missing}"
        )
    columns = [ep.joint_names.index(j) for j in joints]
    return dataclasses.replace(ep, commands=ep.commands[:, columns], joint_names=joints)


class SequenceSampler:
    """Draws packed sequences [B, C, X] and their chunks' actions from a dataset."""

    def __init__(self, data: Dataset, cfg: ModelConfig, *, chunks: int, seed: int) -> None:
        f = cfg.frames_per_chunk
        self.cfg = cfg
        self.codec = Codec(cfg)
        self.chunks = chunks
        self.span = chunks * f
        self.episodes = [ep for ep in data.episodes if len(ep.frames) >= self.span]
        if not self.episodes:
            raise ValueError(
                f"no episode has the {self.span} frames a sequence of {chunks} chunks needs"
            )
        starts = np.array([len(ep.frames) - self.span + 1 for ep in self.episodes], np.float64)
        self.weights = starts / starts.sum()
        self.rng = np.random.default_rng(seed)

    def sequence(self, ep: Episode, start: int) -> torch.Tensor:
        """[C, X] packed chunks of ``ep`` from frame ``start`` (actions included)."""
        f, h = self.cfg.frames_per_chunk, self.cfg.action_horizon
        xs = []
        for c in range(self.chunks):
            first = start + c * f
            latent = self.codec.encode(ep.frames[first : first + f])
            actions = torch.from_numpy(ep.actions_for_chunk(first, f, h))
            xs.append(pack_chunk(self.cfg, latent, actions))
        return torch.stack(xs)

    def batch(self, size: int) -> torch.Tensor:
        """[size, C, X] packed sequences from random episodes and start frames."""
        idx = self.rng.choice(len(self.episodes), size=size, p=self.weights)
        seqs = []
        for i in idx:
            ep = self.episodes[i]
            start = int(self.rng.integers(0, len(ep.frames) - self.span + 1))
            seqs.append(self.sequence(ep, start))
        return torch.stack(seqs)
