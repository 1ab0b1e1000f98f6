"""Shared session-scoped fixtures. Only add fixtures here; others rely on the existing names."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny random Qwen3 model directory with an offline tokenizer, built once per test session."""
    from scirl.synth.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_model"))


@pytest.fixture(scope="session")
def synthetic_rows():
    """SciKnowEval-schema rows from the offline generator."""
    from scirl.synth.questions import generate_rows

    return generate_rows(n_per_domain=20, seed=0)
