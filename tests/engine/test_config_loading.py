"""config.json and generation_config.json that are not what an NLLB checkpoint holds: a CheckpointError naming the
file and the field, never another exception."""
from __future__ import annotations

import json
import re
import shutil

import pytest

from engine.config import load_config, load_generation_defaults
from engine.errors import CheckpointError


@pytest.fixture
def model_dir(toy_dir, tmp_path):
    """The toy model's two config files, to edit."""
    out = tmp_path / "model"
    out.mkdir()
    for name in ("config.json", "generation_config.json"):
        shutil.copy(toy_dir / name, out / name)
    return out


def edit(path, **fields):
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))


def test_a_model_path_that_is_a_file_is_a_checkpoint_error(tmp_path):
    model_file = tmp_path / "model"
    model_file.write_text("not a directory")
    with pytest.raises(CheckpointError, match=re.escape(f"{model_file / 'config.json'} cannot be read: Not a dir")):
        load_config(model_file)


@pytest.mark.parametrize("name", ["config.json", "generation_config.json"])
def test_a_config_file_that_is_a_directory_is_a_checkpoint_error(model_dir, name):
    (model_dir / name).unlink()
    (model_dir / name).mkdir()
    with pytest.raises(CheckpointError, match=f"{name} cannot be read"):
        load_generation_defaults(model_dir) if name.startswith("generation") else load_config(model_dir)


@pytest.mark.parametrize("name", ["config.json", "generation_config.json"])
@pytest.mark.parametrize("document", ["[1, 2]", '"m2m_100"', "null", "3"])
def test_a_config_file_that_holds_no_json_object_is_a_checkpoint_error(model_dir, name, document):
    (model_dir / name).write_text(document)
    with pytest.raises(CheckpointError, match=f"{name} holds a JSON .*, not an object"):
        load_generation_defaults(model_dir) if name.startswith("generation") else load_config(model_dir)


@pytest.mark.parametrize("field, value, says", [
    ("d_model", "x", "d_model is 'x', not an integer"),
    ("vocab_size", [460], r"vocab_size is \[460\], not an integer"),
    ("encoder_layers", None, "encoder_layers is None, not an integer"),
    ("decoder_attention_heads", 0, "decoder_attention_heads is 0; it must be at least 1"),
    ("pad_token_id", "one", "pad_token_id is 'one', not an integer"),
    ("eos_token_id", -1, "eos_token_id is -1; it must be at least 0"),
])
def test_a_config_field_that_is_not_a_fitting_integer_is_a_checkpoint_error_naming_it(model_dir, field, value, says):
    edit(model_dir / "config.json", **{field: value})
    with pytest.raises(CheckpointError, match=f"config.json: {says}"):
        load_config(model_dir)


def test_an_infinite_config_field_is_a_checkpoint_error(model_dir):
    (model_dir / "config.json").write_text((model_dir / "config.json").read_text().replace('"d_model": 64',
                                                                                           '"d_model": Infinity'))
    with pytest.raises(CheckpointError, match="d_model is inf, not an integer"):
        load_config(model_dir)


@pytest.mark.parametrize("value, says", [("lots", "'lots', not an integer"), (-5, "-5; it must be at least 1")])
def test_a_max_length_that_is_not_a_positive_integer_is_a_checkpoint_error(model_dir, value, says):
    edit(model_dir / "generation_config.json", max_length=value)
    with pytest.raises(CheckpointError, match=f"generation_config.json: max_length is {says}"):
        load_generation_defaults(model_dir)

