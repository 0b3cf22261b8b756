"""This package's tests run torch on one thread (see ``tests.conftest.one_torch_thread``)."""

from __future__ import annotations

import pytest

from tests.conftest import one_torch_thread
from tests.engine.tiny import model, tokenizer

__all__ = ["model", "tokenizer"]  # fixtures for this package's tests

one_torch_thread_for_package = pytest.fixture(autouse=True, scope="package")(one_torch_thread)
