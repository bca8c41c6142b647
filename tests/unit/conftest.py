"""Shared fixtures: every exact test runs on every backend available here."""

from dataclasses import dataclass

import pytest
import torch


@dataclass(frozen=True)
class Target:
    """A backend and the device its tensors live on."""

    backend: str
    device: str

    def __str__(self):
        return f"{self.backend}-{self.device}"


TARGETS = [Target("torch", "cpu"), Target("cpu", "cpu")]
if torch.cuda.is_available():
    TARGETS += [Target("torch", "cuda"), Target("cuda", "cuda")]


@pytest.fixture(params=TARGETS, ids=str)
def target(request) -> Target:
    return request.param
