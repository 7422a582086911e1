"""What every engine is assembled from, whatever executes it: the prompts a server holds for
its model, the model's contract (a world-action model's weights carry it) and the summary
logged at start-up."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from physis_ros.contract.model import CONTRACT_KEY, WamContract
from physis_ros.engine.checkpoints import ResolvedModel, summary
from physis_ros.engine.pipeline import Pipeline
from physis_ros.engine.prompts import PromptBook, trained_empty_prompt

log = logging.getLogger(__name__)


def contract_of(checkpoint_meta: dict[str, str] | None) -> WamContract | None:
    """The contract in a checkpoint's metadata (None: it holds none)."""
    if not checkpoint_meta or CONTRACT_KEY not in checkpoint_meta:
        return None
    return WamContract.from_metadata(checkpoint_meta)


def prompt_book(
    resolved: ResolvedModel, *, files: Sequence[str] = (), checkpoint_meta: dict | None = None
) -> PromptBook:
    """The prompts a server holds for a model: its files' named prompts and the model's empty
    prompt (a Wan checkpoint's is its text encoder's, from a prompts file)."""
    cfg = resolved.cfg
    own = resolved.weights is not None
    return PromptBook(
        cfg,
        list(files),
        empty=None if own else trained_empty_prompt(cfg, checkpoint_meta),
        contract=contract_of(checkpoint_meta),
    )


def log_summary(resolved: ResolvedModel, pipeline: Pipeline, checkpoint: str = "") -> None:
    text = summary(
        resolved,
        pipeline.sampler,
        pipeline.model.dtype,
        checkpoint=checkpoint,
        model=pipeline.model,
    )
    log.info("\n%s", text)
