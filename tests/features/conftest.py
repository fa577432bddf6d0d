from __future__ import annotations

import pytest

from kvroute.tokenizer import Tokenizer, load_tokenizer


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    return load_tokenizer()
