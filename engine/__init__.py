"""pdserve engine: model loading, Llama-family forward over a paged KV cache, sampler, `LLM`."""
from engine.errors import (GatedModelError, HubModelError, HubRepoNotFoundError, InvalidRequestError,
                           ModelNotCachedError, OutOfPagesError, PdserveError, ReservationError, UnknownModelError,
                           UnknownRevisionError, UnsupportedArchitectureError, UnsupportedFeatureError)
from engine.engine_config import EngineConfig
from engine.kv_cache.spec import KVPageSpec
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.spec_decode.config import SpeculativeConfig

__all__ = ["LLM", "EngineConfig", "SamplingParams", "SpeculativeConfig", "RequestOutput", "KVPageSpec", "PdserveError",
           "InvalidRequestError", "UnknownModelError", "UnsupportedArchitectureError", "OutOfPagesError",
           "ReservationError", "HubModelError", "ModelNotCachedError", "GatedModelError", "HubRepoNotFoundError",
           "UnknownRevisionError", "UnsupportedFeatureError"]


def __getattr__(name):  # LLM pulls in torch and transformers; import it lazily
    if name == "LLM":
        from engine.llm import LLM
        return LLM
    raise AttributeError(name)
