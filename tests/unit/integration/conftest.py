"""Shared checkpoints of the transformers front-door tests (``hf_checkpoints.py``), written once per session."""

import pytest
from unit.integration.hf_checkpoints import Checkpoints


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> Checkpoints:
    return Checkpoints(tmp_path_factory.mktemp("hf_checkpoints"))
