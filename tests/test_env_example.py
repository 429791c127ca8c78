"""`.env.example` documents every setting of worker/settings.py, with its real default."""
from __future__ import annotations

from pathlib import Path

from worker.settings import Settings

ENV_EXAMPLE = Path(__file__).resolve().parents[1] / ".env.example"


def test_env_example_has_one_line_per_setting_with_its_default():
    text = ENV_EXAMPLE.read_text()
    lines = {line.lstrip("# ").split("=", 1)[0]: line.split("=", 1)[1]
             for line in text.splitlines() if line.lstrip("# ").startswith("NLLB_")}
    assert set(lines) == {f"NLLB_{name.upper()}" for name in Settings.model_fields}
    for name, field in Settings.model_fields.items():
        default = field.default
        default = default.get_secret_value() if hasattr(default, "get_secret_value") else default
        assert lines[f"NLLB_{name.upper()}"] == ("" if default is None else str(default)), name
