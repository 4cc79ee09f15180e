"""Model folders in onnxruntime-genai's format: build, import, load, validate, tokenize.

Importing this package imports NumPy and ``onnx`` (the builder); ``tokenizers``
loads on first use, and ``onnxruntime`` is never imported here: the engine owns
the session and hands its IO to ``check_session_io``.
"""

from kvmux.daemon.model.builder import BUILTIN_SIZES, build_builtin, ensure_builtin
from kvmux.daemon.model.cache import MODEL_CACHE_ENV, default_model_cache, resolve_model
from kvmux.daemon.model.chat import ChatTemplate, ChatTemplateError, load_chat_template
from kvmux.daemon.model.config import (
    IOInfo,
    ModelSpec,
    SearchDefaults,
    check_session_io,
    load_model,
)
from kvmux.daemon.model.errors import ModelFormatError
from kvmux.daemon.model.gguf_import import GGUFImportError, import_gguf
from kvmux.daemon.model.smollm2 import FetchError, ensure_smollm2
from kvmux.daemon.model.tokenizer import IncrementalDecoder, Tokenizer

__all__ = [
    "BUILTIN_SIZES",
    "MODEL_CACHE_ENV",
    "ChatTemplate",
    "ChatTemplateError",
    "FetchError",
    "GGUFImportError",
    "IOInfo",
    "IncrementalDecoder",
    "ModelFormatError",
    "ModelSpec",
    "SearchDefaults",
    "Tokenizer",
    "build_builtin",
    "check_session_io",
    "default_model_cache",
    "ensure_builtin",
    "ensure_smollm2",
    "import_gguf",
    "load_chat_template",
    "load_model",
    "resolve_model",
]
