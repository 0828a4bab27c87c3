"""Triton python-backend `preprocessing` model: text -> token ids (TensorRT-LLM ensemble interface).

Inputs  QUERY STRING [1], REQUEST_OUTPUT_LEN INT32 [1], END_ID INT32 [1] (optional),
        PAD_ID INT32 [1] (optional), STOP_WORDS_DICT STRING [-1] (optional); all with Triton's
        leading batch dimension.
Outputs INPUT_ID INT32 [-1] (right-padded with the pad id), REQUEST_INPUT_LEN INT32 [1],
        REQUEST_OUTPUT_LEN INT32 [1], OUT_END_ID INT32 [1], OUT_PAD_ID INT32 [1],
        STOP_WORDS_IDS INT32 [2, -1] (TensorRT-LLM's stop_words_list layout; only when the
        model config declares it).
Parameters: tokenizer_dir (relative to the version directory unless absolute; default
"tokenizer"), add_special_tokens ("true"/"false", default "true").

Default end id, stop ids and pad id (used when the request carries none):
  1. <tokenizer_dir>/stoker_runtime.json (end_id, stop_ids, pad_id: written by stoker's build
     and render steps for exactly this), else
  2. collected as stoker_stop_words.collect does (every eos id of generation_config.json and the
     tokenizer's eos_token; end_id is the tokenizer's) and generation_config.json pad_token_id
     or tokenizer_config.json pad_token.
The stop ids travel as one-token stop words in STOP_WORDS_IDS, since TensorRT-LLM takes one end
id. A request's STOP_WORDS_DICT replaces them (each word tokenized without special tokens, as
upstream does; [""] means none). No end id anywhere fails initialize: serving without one silently
runs every request to max_tokens, the classic TensorRT-LLM deployment failure. The pad id falls
back to the end id.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils
from tokenizers import Tokenizer

# stoker_stop_words.py is shipped beside this file (no stoker install in Triton).
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from stoker_stop_words import collect, ids as token_ids, to_word_lists


def _param(model_config: dict[str, Any], name: str, default: str) -> str:
    value = model_config.get("parameters", {}).get(name, {}).get("string_value", "")
    # An unfilled template placeholder means "not set", as in upstream's fill_template flow.
    if value == "" or value.startswith("${"):
        return default
    return value


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    return json.loads(path.read_text())


def _token_id(tokenizer: Tokenizer, token: Any) -> int | None:
    if isinstance(token, dict):  # older tokenizer_config.json writes AddedToken dicts
        token = token.get("content")
    if not isinstance(token, str):
        return None
    return tokenizer.token_to_id(token)


def _first_id(value: Any) -> int | None:
    if isinstance(value, list):
        value = value[0] if value else None
    return int(value) if isinstance(value, int) else None


def default_special_ids(tokenizer_dir: Path, tokenizer: Tokenizer) -> tuple[int, int, list[int]]:
    """(end_id, pad_id, stop ids) from the files in `tokenizer_dir`; see the module docstring for the order."""
    runtime = _read_json(tokenizer_dir / "stoker_runtime.json")
    generation = _read_json(tokenizer_dir / "generation_config.json")
    tok_config = _read_json(tokenizer_dir / "tokenizer_config.json")
    if _first_id(runtime.get("end_id")) is not None:
        end_id, stop_ids = _first_id(runtime.get("end_id")), token_ids(runtime.get("stop_ids"))
    else:
        end_id, stop_ids = collect(generation, {}, _token_id(tokenizer, tok_config.get("eos_token")))
    pad_candidates = [
        _first_id(runtime.get("pad_id")),
        _first_id(generation.get("pad_token_id")),
        _token_id(tokenizer, tok_config.get("pad_token")),
    ]
    if end_id is None:
        raise ValueError(
            f"no end id found in {tokenizer_dir} (stoker_runtime.json end_id, generation_config.json "
            "eos_token_id or tokenizer_config.json eos_token); refusing to serve without one"
        )
    pad_id = next((i for i in pad_candidates if i is not None), end_id)
    return end_id, pad_id, list(stop_ids)


def _column(request: Any, name: str, batch: int) -> np.ndarray | None:
    """An optional [batch, 1] input as a flat array of `batch` values."""
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return None
    values = tensor.as_numpy().reshape(-1)
    if values.size != batch:
        raise ValueError(f"{name} has {values.size} values for a batch of {batch}")
    return values


class TritonPythonModel:
    """Tokenizes QUERY with the model's own tokenizer.json (tokenizers library, no transformers)."""

    def initialize(self, args: dict[str, str]) -> None:
        config = json.loads(args["model_config"])
        version_dir = Path(args["model_repository"]) / args["model_version"]
        tokenizer_dir = Path(_param(config, "tokenizer_dir", "tokenizer"))
        if not tokenizer_dir.is_absolute():
            tokenizer_dir = version_dir / tokenizer_dir
        self.tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
        self.add_special_tokens = _param(config, "add_special_tokens", "true").lower() in ("1", "true", "yes")
        self.end_id, self.pad_id, self.stop_ids = default_special_ids(tokenizer_dir, self.tokenizer)
        # Upstream-style configs declare STOP_WORDS_IDS; older hand-written ones may not, and an
        # undeclared output would fail the request.
        self.emit_stop_words = any(o.get("name") == "STOP_WORDS_IDS" for o in config.get("output", []))
        pb_utils.Logger.log_info(
            f"preprocessing: tokenizer {tokenizer_dir}, end_id {self.end_id}, stop ids {self.stop_ids}, "
            f"pad_id {self.pad_id}, "
            f"add_special_tokens {self.add_special_tokens}"
        )

    def _encode(self, request: Any) -> list[Any]:
        queries = pb_utils.get_input_tensor_by_name(request, "QUERY").as_numpy().reshape(-1)
        batch = queries.size
        output_len = _column(request, "REQUEST_OUTPUT_LEN", batch)
        if output_len is None:
            raise ValueError("REQUEST_OUTPUT_LEN is required")
        end_ids = _column(request, "END_ID", batch)
        pad_ids = _column(request, "PAD_ID", batch)
        end = np.full(batch, self.end_id, np.int32) if end_ids is None else end_ids.astype(np.int32)
        pad = np.full(batch, self.pad_id, np.int32) if pad_ids is None else pad_ids.astype(np.int32)

        ids: list[list[int]] = []
        for query in queries:
            text = query.decode("utf-8") if isinstance(query, bytes) else str(query)
            encoded = self.tokenizer.encode(text, add_special_tokens=self.add_special_tokens).ids
            if not encoded:
                raise ValueError("the query tokenizes to no tokens")
            ids.append(encoded)
        width = max(len(x) for x in ids)
        input_ids = np.empty((batch, width), np.int32)
        for row, (encoded, pad_id) in enumerate(zip(ids, pad)):
            input_ids[row, : len(encoded)] = encoded
            input_ids[row, len(encoded):] = pad_id
        lengths = np.array([[len(x)] for x in ids], np.int32)
        outputs = [
            pb_utils.Tensor("INPUT_ID", input_ids),
            pb_utils.Tensor("REQUEST_INPUT_LEN", lengths),
            pb_utils.Tensor("REQUEST_OUTPUT_LEN", output_len.astype(np.int32).reshape(batch, 1)),
            pb_utils.Tensor("OUT_END_ID", end.reshape(batch, 1)),
            pb_utils.Tensor("OUT_PAD_ID", pad.reshape(batch, 1)),
        ]
        if self.emit_stop_words:
            outputs.append(pb_utils.Tensor("STOP_WORDS_IDS", np.array(to_word_lists(self._stop_words(request, batch)),
                                                                      np.int32)))
        return outputs

    def _stop_words(self, request: Any, batch: int) -> list[list[list[int]]]:
        """Per request item: its own STOP_WORDS_DICT tokenized, else the model's stop ids as one-token words."""
        tensor = pb_utils.get_input_tensor_by_name(request, "STOP_WORDS_DICT")
        if tensor is None:
            return [[[i] for i in self.stop_ids]] * batch
        rows = tensor.as_numpy().reshape(batch, -1)
        out = []
        for row in rows:
            words = (w.decode("utf-8") if isinstance(w, bytes) else str(w) for w in row)
            encoded = (self.tokenizer.encode(w, add_special_tokens=False).ids for w in words)
            out.append([e for e in encoded if e])
        return out

    def execute(self, requests: list[Any]) -> list[Any]:
        responses = []
        for request in requests:
            try:
                responses.append(pb_utils.InferenceResponse(output_tensors=self._encode(request)))
            except Exception as exc:  # noqa: BLE001 -- one bad request must not fail the others in the batch
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(f"preprocessing: {exc}")))
        return responses

    def finalize(self) -> None:
        self.tokenizer = None
