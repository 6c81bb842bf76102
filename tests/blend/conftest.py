"""Shared fixtures for the hole-mode CacheBlend tests.

LMCache's ``SegmentTokenDatabase`` loads a Hugging Face tokenizer by model
name to turn ``blend_special_str`` into separator tokens.  No model can be
downloaded here, so a tiny word-level tokenizer (a stand-in for model data,
like the random weights of the reference model) is written to a temporary
directory and that directory is the model name.  Everything else is the real
LMCache class of the stack under test.
"""

from __future__ import annotations

import pytest

from tests.blend.lmcache_setup import (
    make_lmcache_config,
    make_lmcache_engine,
    make_lmcache_metadata,
    write_tiny_tokenizer,
)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-tokenizer")
    write_tiny_tokenizer(directory)
    return directory


@pytest.fixture(scope="session")
def segment_token_database(tiny_model_dir):
    """LMCache's real SegmentTokenDatabase; separator " # # " -> ids [2, 2]."""
    from lmcache.v1.token_database import SegmentTokenDatabase

    database = SegmentTokenDatabase(make_lmcache_config(), make_lmcache_metadata(tiny_model_dir))
    assert database.sep_tokens.tolist() == [2, 2]
    return database


@pytest.fixture(scope="session")
def engine(tiny_model_dir):
    """One real LMCacheEngine for the session (building one takes seconds)."""
    engine = make_lmcache_engine(tiny_model_dir)
    yield engine
    engine.close()
