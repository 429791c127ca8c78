"""Settings the engine could not run are refused when they are read, naming the setting."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from kernels.limits import LORA_MAX_SLOTS
from worker.settings import Settings


def test_more_resident_adapters_than_the_kernels_have_slots_are_refused():
    assert Settings(max_adapters=LORA_MAX_SLOTS - 1).max_adapters == LORA_MAX_SLOTS - 1
    with pytest.raises(ValidationError, match="max_adapters"):
        Settings(max_adapters=LORA_MAX_SLOTS)
