"""One model shape: the registry's ModelInfo and the engine's ModelConfig read the same numbers."""

from __future__ import annotations

import dataclasses

import pytest

from engine.config import ModelConfig
from engine.loader import gguf_reader
from loraplex.modelinfo import ModelInfo, ModelShape, describe_model, gguf_getter, hf_shape
from tests.engine_fixtures import demo_gguf, make_tiny_model  # noqa: F401  (fixture)

SHAPE_FIELDS = [f.name for f in dataclasses.fields(ModelShape)]


def _shape(obj: ModelShape) -> dict:
    return {k: getattr(obj, k) for k in SHAPE_FIELDS}


def test_hf_shape_defaults():
    cfg = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
           "vocab_size": 100}
    assert hf_shape(cfg) == {"architecture": "llama", "hidden_size": 64, "intermediate_size": 96, "num_layers": 2,
                             "num_heads": 4, "num_kv_heads": 4, "head_dim": 16, "vocab_size": 100,
                             "context_length": 2048}


def test_model_info_and_model_config_share_the_shape():
    """Neither repeats the other's fields: both are a ModelShape plus their own."""
    own_info = {f.name for f in dataclasses.fields(ModelInfo)} - set(SHAPE_FIELDS)
    own_config = {f.name for f in dataclasses.fields(ModelConfig)} - set(SHAPE_FIELDS)
    assert issubclass(ModelInfo, ModelShape) and issubclass(ModelConfig, ModelShape)
    assert own_info == {"name", "revision"}
    assert not own_config & {"max_position_embeddings", "name", "revision"}
    info = ModelInfo(name="m", revision="r", architecture="llama", hidden_size=64, intermediate_size=96,
                     num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=100, context_length=128)
    assert info.projection_shape("k_proj") == (64, 32) and info.projection_shape("down_proj") == (96, 64)
    with pytest.raises(KeyError):
        info.projection_shape("lm_head")


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_hf_directory_reads_the_same_both_ways(tmp_path, kind):
    path = make_tiny_model(tmp_path, kind, seed=1)
    info, cfg = describe_model(path), ModelConfig.from_hf_dir(path)
    assert _shape(info) == _shape(cfg)
    assert info.architecture == kind and info.to_dict()["revision"] == info.revision
    assert describe_model(path, shape=cfg) == info, "the engine's description of its model is the registry's"


@pytest.mark.slow
def test_gguf_reads_the_same_both_ways(demo_gguf):  # noqa: F811
    reader = gguf_reader(demo_gguf)
    cfg = ModelConfig.from_gguf_fields(gguf_getter(reader), set(reader.tensors))
    info = describe_model(demo_gguf)
    assert _shape(info) == _shape(cfg)
    assert (info.hidden_size, info.num_layers, info.num_kv_heads, info.vocab_size) == (576, 30, 3, 49152)
