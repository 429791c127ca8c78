"""Shared fixtures: the bundled toy checkpoint, one CPU engine on it, and HF's model as oracle."""
from __future__ import annotations

import pytest
import torch

from engine import TOY_MODEL_DIR, Engine


@pytest.fixture(scope="session")
def toy_dir():
    return TOY_MODEL_DIR


@pytest.fixture(scope="session")
def toy_engine():
    eng = Engine.load(TOY_MODEL_DIR, device="cpu", max_rows=48)
    yield eng
    eng.close()


@pytest.fixture
def engine(toy_engine):
    """The session engine, checked to hand every row back after each test."""
    yield toy_engine
    assert toy_engine.table.is_empty, "a test left rows or source tokens allocated"
    assert toy_engine.scheduler.idle


@pytest.fixture(scope="session")
def hf_toy():
    transformers = pytest.importorskip("transformers")
    torch.set_num_threads(2)
    return transformers.M2M100ForConditionalGeneration.from_pretrained(TOY_MODEL_DIR).eval()
