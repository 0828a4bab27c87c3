"""The xgrammar tokenizer info file the engine's `tensorrt_llm` model reads to enforce guided decoding.

TensorRT-LLM's C++ backend constrains `guided_decoding_guide` only when its config names a guided decoding backend
and this file (tensorrtllm_backend docs/guided_decoding.md; its model_instance_state.cc reads the keys
`encoded_vocab`, `tokenizer_str` and `stop_token_ids`). Upstream writes it with
examples/generate_xgrammar_tokenizer_info.py, i.e. `tensorrt_llm.llmapi.tokenizer._xgrammar_tokenizer_info` (read
at TensorRT-LLM's tensorrt_llm/llmapi/tokenizer.py): for a fast tokenizer, the vocabulary's token strings in id order,
the backend tokenizer serialized (`to_str()`, from which xgrammar detects the vocabulary type and whether a space is
prepended) and `[eos_token_id]`. stoker renders the same from the model's tokenizer.json with `tokenizers` (the
orchestrator has no transformers or torch), with two differences:

- the stop id is the build's end id (ModelFacts.end_id, what preprocessing sends as end_id), not tokenizer_config's
  eos: it is the token the engine ends a sequence on, so it is the one the grammar must allow once complete
  (Llama 3 Instruct: <|eot_id|>, while its tokenizer's eos may be <|end_of_text|>);
- position i of `encoded_vocab` is always token id i: an id no token has is an empty string (as xgrammar's own
  `TokenizerInfo.from_huggingface` fills it), where upstream's plain sort would move every later token onto the
  wrong id. For a vocabulary without gaps (every tokenizer.json stoker has met) the two lists are the same.
"""

from __future__ import annotations

import json

from ..errors import StepError

BACKEND = "xgrammar"  # the only guided decoding backend TensorRT-LLM's C++ runtime takes
FILE = "xgrammar_tokenizer_info.json"


def render(tokenizer_json: str, end_id: int | None) -> str:
    """The file's text (JSON: encoded_vocab, tokenizer_str, stop_token_ids) from tokenizer.json's text and the
    build's end id.

    Raises StepError (one line): tokenizer.json does not load, or its vocabulary is empty, or the end id is none of
    its tokens (e.g. None: the model named no end id), since the grammar's only way out would then not exist.
    """
    from tokenizers import Tokenizer

    try:
        tokenizer = Tokenizer.from_str(tokenizer_json)
    except Exception as exc:  # noqa: BLE001 -- tokenizers raises a bare Exception for any malformed file
        raise StepError(f"guided decoding: tokenizer.json does not load: {exc}") from None
    by_id = {i: token for token, i in tokenizer.get_vocab(with_added_tokens=True).items()}
    if not by_id:
        raise StepError("guided decoding: tokenizer.json has an empty vocabulary")
    encoded_vocab = [by_id.get(i, "") for i in range(max(by_id) + 1)]
    if end_id is None or end_id not in by_id:
        raise StepError(f"guided decoding: the end id {end_id} is no token of tokenizer.json (size "
                        f"{len(encoded_vocab)}); the grammar could never end")
    doc = {"encoded_vocab": encoded_vocab, "tokenizer_str": tokenizer.to_str(), "stop_token_ids": [end_id]}
    return json.dumps(doc) + "\n"
