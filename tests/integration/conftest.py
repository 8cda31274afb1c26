"""Fixtures shared by the in-process daemon tests."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from cachexferd.client import EngineClient

    from ..helpers import InProcessDaemon


@pytest.fixture
def engine(inproc: InProcessDaemon) -> Iterator[EngineClient]:
    """An engine client connected to the in-process daemon."""
    from cachexferd.client import EngineClient

    client = EngineClient([inproc.endpoint], timeout_s=20)
    client.connect()
    yield client
    client.close()
