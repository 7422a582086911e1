"""physis-embed: prompts through a local umT5 encoder into a prompt-embeddings file, equal to
what diffusers' WanPipeline feeds its transformer; refusals when no encoder is usable."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from wan_fixtures import make_text_encoder

from physis_ros.engine.config import get_preset
from physis_ros.engine.forward import pad_text
from physis_ros.engine.prompts import EMPTY, PromptBook, read_prompts, write_prompts
from physis_ros.tools import embed_cli

TEXT_LEN = 12


@pytest.fixture(scope="module")
def encoder_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipe")
    make_text_encoder(root)
    return root


def test_embeddings_equal_diffusers_prompt_encoding(encoder_dir, tmp_path):
    from diffusers import WanPipeline

    out = tmp_path / "prompts.safetensors"
    prompts = {"pick": "a robot  arm picks up the red cube", "idle": "the arm holds &amp; still"}
    code = embed_cli.main(
        ["--encoder", str(encoder_dir), "--out", str(out), "--text-len", str(TEXT_LEN)]
        + [f"--prompt={n}={t}" for n, t in prompts.items()]
    )
    assert code == 0
    pf = read_prompts(out)
    assert set(pf.embeddings) == {"pick", "idle", EMPTY} and pf.text_dim == 16
    assert pf.embeddings[EMPTY].shape[0] == 1  # "" is the end token alone
    enc = embed_cli.TextEncoder(encoder_dir)
    pipe = WanPipeline(tokenizer=enc.tokenizer, text_encoder=enc.model, vae=None, scheduler=None)
    cfg = get_preset("tiny", text_dim=16, text_len=TEXT_LEN)
    for name, text in {**prompts, EMPTY: ""}.items():
        ref = pipe._get_t5_prompt_embeds(text, max_sequence_length=TEXT_LEN)[0]
        ours = pad_text(cfg, pf.embeddings[name])
        assert ours.shape == ref.shape == (TEXT_LEN, 16)
        diff = (ours - ref.float()).abs().max().item()
        print(name, "max |physis-embed - diffusers|", diff)
        assert diff <= 1e-5, name  # float rounding of batched vs single-prompt GEMMs
        n = pf.embeddings[name].shape[0]  # the real tokens; diffusers pads with zeros after them
        assert ref[n - 1].any() and not ref[n:].any(), name


def test_prompt_book_by_name_raw_and_empty(encoder_dir, tmp_path):
    out = tmp_path / "p.safetensors"
    embed_cli.main(
        [
            "--encoder",
            str(encoder_dir),
            "--out",
            str(out),
            "--text-len",
            "8",
            "--prompt",
            "pick=red cube",
        ]
    )
    cfg = get_preset("tiny", text_dim=16, text_len=8)
    book = PromptBook(cfg, [out])
    assert book.names() == ["empty", "pick"]
    assert torch.equal(book.resolve(), book.resolve("empty"))
    raw = np.ones((3, 16), np.float16)
    assert torch.equal(book.resolve(raw=raw), torch.ones(3, 16))
    with pytest.raises(ValueError, match="unknown prompt 'nope'"):
        book.resolve("nope")
    with pytest.raises(ValueError, match="not both"):
        book.resolve("pick", raw)
    with pytest.raises(ValueError, match=r"\[9, 16\].*\[n <= 8, 16\]"):
        book.resolve(raw=np.zeros((9, 16), np.float32))
    with pytest.raises(ValueError, match="NaN"):
        book.resolve(raw=np.full((2, 16), np.nan, np.float32))
    with pytest.raises(ValueError, match="float32 or float16"):
        book.resolve(raw=np.zeros((2, 16), np.float64))
    with pytest.raises(ValueError, match="width 16, model tiny takes 4"):
        PromptBook(get_preset("tiny", text_dim=4, text_len=8), [out])
    with pytest.raises(ValueError, match=r"no empty-prompt embedding.*physis-embed"):
        PromptBook(cfg).resolve()


def test_refusals_say_what_is_missing(tmp_path):
    (tmp_path / embed_cli.PICKLED_T5).write_bytes(b"pickle")
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "physis_ros.tools.embed_cli",
            "--encoder",
            str(tmp_path),
            "--out",
            str(tmp_path / "o.safetensors"),
            "--prompt",
            "a=b",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 2 and "pickle file, which is never loaded" in run.stderr
    assert not (tmp_path / "o.safetensors").exists()
    with pytest.raises(embed_cli.EncoderUnavailable, match="no text encoder found"):
        embed_cli.find_encoder(tmp_path / "nothing")
    bad = tmp_path / "bad.safetensors"
    write_prompts(bad, {"x": torch.zeros(2, 4)}, texts={}, encoder="test", text_len=4)
    shown = subprocess.run(
        [sys.executable, "-m", "physis_ros.tools.embed_cli", "--show", str(bad)],
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(shown.stdout)["prompts"]["x"]["tokens"] == 2


def test_empty_prompt_of_models_without_a_text_encoder():
    from physis_ros.contract.safetensors import read_metadata
    from physis_ros.engine.forward import make_cond
    from physis_ros.engine.prompts import cond_from_json, cond_to_json, trained_empty_prompt
    from physis_ros.weights import DEFAULT_WEIGHTS

    # the shipped push-wm was trained on make_cond(cfg, 0): its metadata says cond_seed 0
    cfg = get_preset("push-wm")
    shipped = trained_empty_prompt(cfg, read_metadata(DEFAULT_WEIGHTS))
    assert torch.equal(shipped, make_cond(cfg, 0))
    assert trained_empty_prompt(get_preset("tiny"), None).shape == (0, 16)  # random weights
    assert torch.equal(cond_from_json(cond_to_json(shipped)), shipped)  # to the ranks, exact


def test_a_model_conditioned_on_its_task_takes_the_task_values():
    """push-wam's contract makes its prompt of the task's values (task_features of goal_x,
    goal_y): a stream opened with them is conditioned on prompt_features(values, 0.5)
    (physis-serve refuses a client's stream without them: test_serve_wam.py); values outside
    the trained range are refused; a model without such a contract takes no task values."""
    import numpy as np

    from physis_ros.contract.model import ContractError, WamContract, prompt_features
    from physis_ros.contract.safetensors import read_metadata
    from physis_ros.engine.prompts import trained_empty_prompt
    from physis_ros.weights import WAM_WEIGHTS

    cfg = get_preset("push-wam")
    contract = WamContract.from_metadata(read_metadata(WAM_WEIGHTS))
    book = PromptBook(cfg, empty=trained_empty_prompt(cfg, {}), contract=contract)
    cond = book.resolve(task={"goal_x": 0.12, "goal_y": -0.305})
    np.testing.assert_array_equal(cond.numpy(), prompt_features((0.12, -0.305), 0.5, cfg.text_dim))
    assert not torch.equal(cond, book.resolve(task={"goal_x": -0.12, "goal_y": -0.305}))
    assert book.resolve("").shape == (0, cfg.text_dim)  # all padding: the engine measuring
    with pytest.raises(ContractError, match="outside the range"):
        book.resolve(task={"goal_x": 0.9, "goal_y": 0.0})
    with pytest.raises(ValueError, match="not both"):
        book.resolve("empty", task={"goal_x": 0.1, "goal_y": 0.0})
    plain = PromptBook(cfg, empty=trained_empty_prompt(cfg, {"cond_seed": "0"}))
    assert torch.equal(
        plain.resolve("", task={"goal_x": 0.1, "goal_y": 0.0}),
        trained_empty_prompt(cfg, {"cond_seed": "0"}),
    )  # no task_features contract: the task's values make no prompt
    assert torch.equal(plain.resolve(""), trained_empty_prompt(cfg, {"cond_seed": "0"}))


def test_an_encoder_whose_files_lack_a_weight_is_refused(tmp_path):
    """transformers would keep the missing weight at its random init and only log it."""
    make_text_encoder(tmp_path)
    weights = next((tmp_path / "text_encoder").glob("*.safetensors"))
    state = load_file(str(weights))
    key = "encoder.final_layer_norm.weight"
    del state[key]
    save_file(state, str(weights), metadata={"format": "pt"})
    with pytest.raises(embed_cli.EncoderUnavailable, match=rf"missing 1 key\(s\) \['{key}'\]"):
        embed_cli.TextEncoder(tmp_path)
