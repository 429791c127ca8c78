"""docs/protocol.md, the producers' wire protocol, says what worker/messages.py and the settings do:
every field of the models and every error code is documented, every JSON example parses with the
models, and the names and defaults the page gives are the settings' own."""
from __future__ import annotations

import inspect
import json
import re
import typing
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from worker import messages
from worker.topology import jobs_queue_arguments
from worker.settings import Settings

DOC = Path(__file__).resolve().parents[1] / "docs" / "protocol.md"
TEXT = DOC.read_text()
FLAT = " ".join(TEXT.split())  # phrases looked up whatever the line breaks


def models() -> list[type[BaseModel]]:
    """Every pydantic model of worker/messages.py that has fields (job, options, replies, parts)."""
    return [m for _, m in inspect.getmembers(messages, inspect.isclass)
            if issubclass(m, BaseModel) and m is not BaseModel and m.model_fields]


def nested_models(annotation: Any) -> list[type[BaseModel]]:
    if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in nested_models(arg)]


def unknown_keys(model: type[BaseModel], data: dict[str, Any], path: str = "") -> list[str]:
    """Keys of `data` that are no field of `model` (recursively): replies ignore unknown fields, so
    validation alone would let a misspelt example pass."""
    out = []
    for key, value in data.items():
        field = model.model_fields.get(key)
        if field is None:
            out.append(path + key)
            continue
        items = value if isinstance(value, list) else [value]
        for sub in nested_models(field.annotation):
            for item in items:
                if isinstance(item, dict):
                    out += unknown_keys(sub, item, f"{path}{key}.")
    return out


def json_examples() -> list[Any]:
    return [json.loads(block) for block in re.findall(r"```json\n(.*?)```", TEXT, re.S)]


def test_every_field_of_the_models_is_documented():
    missing = {f"{m.__name__}.{name}" for m in models() for name in m.model_fields
               if f"`{name}`" not in TEXT and f'"{name}"' not in TEXT}
    assert not missing


def test_error_codes_and_their_retryable_flag_are_the_models():
    table = dict(re.findall(r"^\| `([a-z_]+)` \| (yes|no) \|", TEXT, re.M))
    assert set(table) == set(messages.ERROR_CODES)
    assert {code: flag == "yes" for code, flag in table.items()} == {
        code: messages.RETRYABLE.get(code, False) for code in messages.ERROR_CODES}


def test_every_json_example_parses_with_the_models():
    examples = json_examples()
    assert len(examples) >= 8
    kinds = set()
    for example in examples:
        body = json.dumps(example).encode()
        if {"text", "texts", "document"} & set(example) and "status" not in example:
            messages.parse_job(body)  # strict: an unknown field raises BadJob
            kinds.add("job")
            continue
        candidates = [m for m in models() if set(example) <= set(m.model_fields)
                      and ("status" not in example or example["status"] in
                           typing.get_args(m.model_fields["status"].annotation))]
        fits = []
        for model in candidates:
            try:
                model.model_validate(example)
            except ValueError:
                continue
            if not unknown_keys(model, example):
                fits.append(model)
        assert fits, f"no model of worker/messages.py takes this example: {example}"
        kinds.add(example.get("status", "control"))
    assert kinds >= {"job", "ok", "error", "partial", "control"}


def test_topology_and_limits_are_the_settings_defaults():
    fields = Settings.model_fields
    for name in ("jobs_queue", "dead_letter_exchange", "dead_letter_queue"):
        assert f"`{fields[name].default}` (`NLLB_{name.upper()}`)" in FLAT
    assert f"`x-delivery-limit` {fields['delivery_limit'].default}" in FLAT
    arguments = jobs_queue_arguments(Settings(_env_file=None))
    assert f"`x-overflow` `{arguments['x-overflow']}`" in FLAT
    for setting in sorted(set(re.findall(r"NLLB_([A-Z_]+)", TEXT))):
        assert setting.lower() in fields, f"the page names NLLB_{setting}, which is no setting"


@pytest.mark.parametrize("setting, shown, value", [("max_message_bytes", "8 MiB", 8 * 2**20),
                                                   ("max_segment_chars", "50,000", 50_000),
                                                   ("max_segments", "256", 256),
                                                   ("max_document_chars", "100,000", 100_000),
                                                   ("cancel_memory_s", "600 s", 600)])
def test_limits_shown_are_the_defaults(setting, shown, value):
    assert Settings.model_fields[setting].default == value
    assert f"`NLLB_{setting.upper()}` ({shown})" in FLAT
