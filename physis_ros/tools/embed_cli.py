"""``physis-embed``: prompts -> a prompt-embeddings file, with a text encoder on this machine.

Runs once, outside the control loop: the text encoder is not part of the pipeline. It reads a
umT5 encoder and its tokenizer from disk (a diffusers Wan pipeline's ``text_encoder/`` and
``tokenizer/``, or one directory holding both), encodes each prompt as the Wan pipelines do
(whitespace cleaned, tokenized to at most ``--text-len`` tokens with the end token, encoded
with the attention mask, only the real tokens kept) and writes the file ``physis-serve
--prompts`` reads (``physis_ros.engine.prompts``), always with the empty prompt as ``empty``.

    physis-embed --encoder Wan2.1-T2V-1.3B-Diffusers --out prompts.safetensors \\
        --prompt pick="a robot arm picks up the red cube" --prompt idle="the arm holds still"

Needs the optional ``transformers`` package; never downloads anything. ``--show FILE`` lists
a file's prompts.
"""

from __future__ import annotations

import argparse
import html
import json
import re
import sys
from pathlib import Path

import torch
import yaml

from physis_ros.cli_errors import cli_main
from physis_ros.engine.prompts import EMPTY, check_name, read_prompts, write_prompts
from physis_ros.engine.weight_files import partial_load_problem

PICKLED_T5 = "models_t5_umt5-xxl-enc-bf16.pth"
"""Upstream Wan ships its encoder as this pickle file: never loaded here."""


class EncoderUnavailable(ValueError):
    """No text encoder can be used here; the message says what is missing."""


def clean_prompt(text: str) -> str:
    """As the Wan pipelines: HTML entities unescaped, whitespace runs collapsed."""
    return re.sub(r"\s+", " ", html.unescape(html.unescape(text))).strip()


def find_encoder(path: Path) -> tuple[Path, Path]:
    """(encoder directory, tokenizer directory) under ``path``, or EncoderUnavailable."""
    if (path / "text_encoder").is_dir() and (path / "tokenizer").is_dir():
        return path / "text_encoder", path / "tokenizer"
    if (path / "config.json").exists() and any(
        (path / name).exists() for name in ("tokenizer.json", "spiece.model")
    ):
        return path, path
    if (path / PICKLED_T5).exists():
        raise EncoderUnavailable(
            f"{path} holds the upstream umT5 encoder as {PICKLED_T5}, a pickle file, which is "
            "never loaded; use a diffusers Wan pipeline's text_encoder/ and tokenizer/ "
            "(safetensors), e.g. from the model's -Diffusers repository"
        )
    raise EncoderUnavailable(
        f"{path}: no text encoder found (expected text_encoder/ and tokenizer/ of a diffusers "
        "Wan pipeline, or a directory with a umT5 encoder's config.json, safetensors and "
        "tokenizer)"
    )


class TextEncoder:
    """A umT5 encoder and tokenizer from local files only."""

    def __init__(self, path: str | Path, *, device: str = "cpu", dtype: str = "float32") -> None:
        try:
            from transformers import AutoTokenizer, UMT5EncoderModel
        except ImportError as err:
            raise EncoderUnavailable(
                "physis-embed needs the transformers package (pip install "
                "'physis_ros[models]') and a umT5 encoder on disk; without them, compute the "
                "embeddings elsewhere and write them with physis_ros.engine.prompts."
                "write_prompts"
            ) from err
        enc_dir, tok_dir = find_encoder(Path(path))
        if not any(enc_dir.glob("*.safetensors")):
            raise EncoderUnavailable(f"{enc_dir}: no safetensors weights")
        self.source = str(path)
        self.device = torch.device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)
        model, loading = UMT5EncoderModel.from_pretrained(
            str(enc_dir),
            local_files_only=True,
            use_safetensors=True,
            dtype=getattr(torch, dtype),
            output_loading_info=True,
        )
        if problem := partial_load_problem(f"text encoder {enc_dir}", loading):
            raise EncoderUnavailable(problem)
        self.model = model.to(self.device)
        self.model.eval()

    @property
    def width(self) -> int:
        return int(self.model.config.d_model)

    @torch.inference_mode()
    def encode(self, texts: list[str], *, text_len: int) -> list[torch.Tensor]:
        """Each text -> [n_i, width] float32: the encoder's output at its real tokens."""
        batch = self.tokenizer(
            [clean_prompt(t) for t in texts],
            padding="max_length",
            max_length=text_len,
            truncation=True,
            add_special_tokens=True,
            return_attention_mask=True,
            return_tensors="pt",
        )
        ids = batch.input_ids.to(self.device)
        mask = batch.attention_mask.to(self.device)
        hidden = self.model(ids, mask).last_hidden_state.float().cpu()
        lengths = mask.gt(0).sum(dim=1).tolist()
        return [hidden[i, :n].clone() for i, n in enumerate(lengths)]


def embed(
    encoder: TextEncoder, prompts: dict[str, str], out: str | Path, *, text_len: int
) -> dict[str, int]:
    """Write ``prompts`` (name -> text) and the empty prompt to ``out``; name -> tokens."""
    if EMPTY in prompts and clean_prompt(prompts[EMPTY]):
        raise ValueError(f"the name {EMPTY!r} is reserved for the empty prompt")
    texts = {**{check_name(n): t for n, t in prompts.items()}, EMPTY: ""}
    names = list(texts)
    embedded = encoder.encode([texts[n] for n in names], text_len=text_len)
    tensors = dict(zip(names, embedded, strict=True))
    write_prompts(out, tensors, texts=texts, encoder=encoder.source, text_len=text_len)
    return {n: int(t.shape[0]) for n, t in tensors.items()}


def _parse_prompts(args: argparse.Namespace) -> dict[str, str]:
    prompts: dict[str, str] = {}
    for item in args.prompt or []:
        name, sep, text = item.partition("=")
        if not sep:
            raise ValueError(f"--prompt {item!r} is not NAME=TEXT")
        prompts[check_name(name.strip())] = text
    if args.prompts_file:
        data = yaml.safe_load(Path(args.prompts_file).read_text()) or {}
        if not isinstance(data, dict) or not all(isinstance(v, str) for v in data.values()):
            raise ValueError(f"{args.prompts_file}: expected a mapping of name: prompt text")
        prompts.update({check_name(str(k)): v for k, v in data.items()})
    return prompts


@cli_main("physis-embed")
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="physis-embed", description=__doc__.split("\n\n")[0])
    p.add_argument("--encoder", help="diffusers Wan pipeline dir (text_encoder/, tokenizer/)")
    p.add_argument("--out", help="prompt-embeddings file to write (.safetensors)")
    p.add_argument("--prompt", action="append", metavar="NAME=TEXT", help="repeatable")
    p.add_argument("--prompts-file", help="YAML mapping name: prompt text")
    p.add_argument("--text-len", type=int, default=512, help="max tokens (the model's text_len)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--show", metavar="FILE", help="list the prompts of a file and exit")
    args = p.parse_args(argv)
    try:
        if args.show:
            pf = read_prompts(args.show)
            rows = {
                n: {"tokens": int(t.shape[0]), "text": pf.texts.get(n, "")}
                for n, t in sorted(pf.embeddings.items())
            }
            print(
                json.dumps(
                    {"encoder": pf.encoder, "text_dim": pf.text_dim, "prompts": rows}, indent=1
                )
            )
            return 0
        if not args.encoder or not args.out:
            p.error("--encoder and --out are required (or --show FILE)")
        if args.text_len < 1:
            raise ValueError(f"--text-len must be >= 1, got {args.text_len}")
        prompts = _parse_prompts(args)
        encoder = TextEncoder(args.encoder, device=args.device, dtype=args.dtype)
        tokens = embed(encoder, prompts, args.out, text_len=args.text_len)
    except (ValueError, OSError) as err:
        print(f"physis-embed: {err}", file=sys.stderr)
        return 2
    print(json.dumps({"out": args.out, "text_dim": encoder.width, "tokens": tokens}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
