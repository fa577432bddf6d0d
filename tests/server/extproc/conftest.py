from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture
async def gateway(tmp_path: Path) -> AsyncIterator[Any]:
    """Engines, picker and Envoy for one test (each test starts what it needs); all stopped after.
    Skips when the gateway extra is not installed."""
    from tests.server.extproc.harness import Gateway, envoy_or_skip

    envoy_or_skip()
    g = Gateway(tmp_path)
    yield g
    await g.close()
