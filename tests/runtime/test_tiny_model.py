"""The tiny model: deterministic files, loadable offline by transformers."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from typer.testing import CliRunner

from prorsa.cli.main import app
from prorsa.errors import ConfigError
from prorsa.runtime.ray.tiny_model import TinyModelSpec, make_tiny_model


def digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_same_seed_same_files_other_seed_other_weights(tiny_model_dir, tmp_path):
    again = make_tiny_model(tmp_path / "again", seed=0)
    other = make_tiny_model(tmp_path / "other", seed=1)
    assert digest(again) == digest(tiny_model_dir)
    differing = {k for k, v in digest(other).items() if digest(again)[k] != v}
    assert "model.safetensors" in differing and "tokenizer.json" not in differing


def test_loads_offline_with_transformers(tiny_model_dir):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir, local_files_only=True)
    config = AutoConfig.from_pretrained(tiny_model_dir, local_files_only=True)
    assert len(tokenizer) == config.vocab_size == 512
    assert config.head_dim == 64 and config.num_hidden_layers == 2
    assert config.max_position_embeddings >= 2048
    ids = tokenizer("Observation: 3 tests passed.")["input_ids"]
    assert tokenizer.decode(ids) == "Observation: 3 tests passed."
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, local_files_only=True)
    assert model.dtype == torch.float32
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), 512)


def test_bad_spec_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="vocab_size"):
        make_tiny_model(tmp_path / "m", spec=TinyModelSpec(vocab_size=100))


def test_cli_make_tiny(tiny_model_dir, tmp_path):
    result = CliRunner().invoke(app, ["models", "make-tiny", "--out", str(tmp_path / "m")])
    assert result.exit_code == 0, result.output
    assert digest(tmp_path / "m") == digest(tiny_model_dir)
    bad = CliRunner().invoke(app, ["models", "make-tiny", "--out", "/dev/null/m"])
    assert bad.exit_code == 1 and "/dev/null/m" in bad.output and "not a folder" in bad.output
