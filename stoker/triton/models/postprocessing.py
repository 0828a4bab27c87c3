"""Triton python-backend `postprocessing` model: token ids -> text (TensorRT-LLM ensemble interface).

Inputs  TOKENS_BATCH INT32 [-1, -1] (beam, tokens), SEQUENCE_LENGTH INT32 [-1] (per beam); both
        with Triton's leading batch dimension.
Outputs OUTPUT STRING [-1]: one text per beam, shape [batch, beam].
Parameters: tokenizer_dir (relative to the version directory unless absolute; default
"tokenizer"), skip_special_tokens ("true"/"false", default "true").

Each response is decoded on its own, as upstream does: while streaming, every token becomes
text separately. For byte-level BPE that is exact unless one UTF-8 character spans tokens
(then each piece decodes to U+FFFD); SentencePiece-style tokenizers may lose a leading space
per token. Stateless decoding keeps the model batchable and free of per-request state.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils
from tokenizers import Tokenizer


def _param(model_config: dict[str, Any], name: str, default: str) -> str:
    value = model_config.get("parameters", {}).get(name, {}).get("string_value", "")
    if value == "" or value.startswith("${"):
        return default
    return value


class TritonPythonModel:
    """Detokenizes each beam up to its sequence length."""

    def initialize(self, args: dict[str, str]) -> None:
        config = json.loads(args["model_config"])
        version_dir = Path(args["model_repository"]) / args["model_version"]
        tokenizer_dir = Path(_param(config, "tokenizer_dir", "tokenizer"))
        if not tokenizer_dir.is_absolute():
            tokenizer_dir = version_dir / tokenizer_dir
        self.tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
        self.skip_special_tokens = _param(config, "skip_special_tokens", "true").lower() in ("1", "true", "yes")

    def _decode(self, request: Any) -> pb_utils.Tensor:
        tokens = pb_utils.get_input_tensor_by_name(request, "TOKENS_BATCH").as_numpy()
        lengths = pb_utils.get_input_tensor_by_name(request, "SEQUENCE_LENGTH").as_numpy()
        if tokens.ndim == 2:  # [batch, tokens] from a caller without a beam axis
            tokens = tokens[:, None, :]
        lengths = lengths.reshape(tokens.shape[0], -1)
        if lengths.shape[1] != tokens.shape[1]:
            raise ValueError(f"SEQUENCE_LENGTH {lengths.shape} does not match TOKENS_BATCH {tokens.shape}")
        texts = np.empty(tokens.shape[:2], dtype=object)
        for b in range(tokens.shape[0]):
            for beam in range(tokens.shape[1]):
                n = int(lengths[b, beam])
                if not 0 <= n <= tokens.shape[2]:
                    raise ValueError(f"sequence length {n} outside 0..{tokens.shape[2]}")
                ids = tokens[b, beam, :n].tolist()
                texts[b, beam] = self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens).encode("utf-8")
        return pb_utils.Tensor("OUTPUT", texts)

    def execute(self, requests: list[Any]) -> list[Any]:
        responses = []
        for request in requests:
            try:
                responses.append(pb_utils.InferenceResponse(output_tensors=[self._decode(request)]))
            except Exception as exc:  # noqa: BLE001 -- one bad request must not fail the others in the batch
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(f"postprocessing: {exc}")))
        return responses

    def finalize(self) -> None:
        self.tokenizer = None
