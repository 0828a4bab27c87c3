"""The live build as the OpenAI service sees it: its tokenizer, chat template and context length.

Read from the build's own files (those stoker's reference build writes beside the weights, and the
model repository carries in ``tensorrt_llm/<version>/weights/``): tokenizer.json,
tokenizer_config.json, special_tokens_map.json, chat_template.jinja / chat_template.json,
config.json. In a deployment stoker writes ``live.json`` into the service's state folder at every
switch (``stoker.serving.openai_service``); the service re-reads it when it changes, so the
tokenizer follows the build the proxy routes to.

Chat template: the model's own (chat_template.jinja, else chat_template.json, else
tokenizer_config.json's ``chat_template``; a named list picks ``default``), rendered by
transformers' renderer as ``apply_chat_template`` does, then tokenized without special tokens
(the template writes them). A model without one gets ``FALLBACK_CHAT_TEMPLATE``, tokenized with
the tokenizer's special tokens (its BOS); /v1/models says which one is in use.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from .layout import ASSET_FILES, LIMITS_FILE, LIVE_FILE
from .mapping import ApiError, bad_request, unavailable
from .token_bytes import TokenBytes
from .triton_stream import INTERFACES

__all__ = ["ASSET_FILES", "LIVE_FILE", "FALLBACK_CHAT_TEMPLATE", "LiveModel", "ServedModel"]
FALLBACK_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")
# config.json keys that give the context length, by architecture family
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


def _json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _content(token: Any) -> str | None:
    if isinstance(token, dict):  # AddedToken as older tokenizer_config.json files write it
        token = token.get("content")
    return token if isinstance(token, str) else None


def find_chat_template(folder: Path) -> tuple[str | None, str]:
    """(template, where it came from); (None, "none") when the model has none."""
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text(), "chat_template.jinja"
    for name in ("chat_template.json", "tokenizer_config.json"):
        value = _json(folder / name).get("chat_template")
        if isinstance(value, list):  # [{"name": …, "template": …}]
            value = next((t.get("template") for t in value if t.get("name") == "default"), None)
        if isinstance(value, str) and value.strip():
            return value, name
    return None, "none"


def context_length(config: dict) -> int | None:
    for key in CONTEXT_KEYS:
        if isinstance(config.get(key), int) and config[key] > 0:
            return int(config[key])
    return None


def render_chat(template: str, messages: list[dict], special: dict[str, str], tools: list[dict] | None = None) -> str:
    """``messages`` through ``template`` with the generation prompt, as transformers' apply_chat_template renders;
    ``tools``: the request's tools as OpenAI sends them (tools.py), which the template renders its own way."""
    import jinja2
    from transformers.utils.chat_template_utils import render_jinja_template

    try:
        rendered, _ = render_jinja_template([messages], tools=tools, chat_template=template,
                                            add_generation_prompt=True, **special)
    except jinja2.TemplateError as err:  # the template's own raise_exception, or a message it cannot take
        raise bad_request(f"the model's chat template refused the messages: {err}", "messages") from None
    return rendered[0]


@dataclass
class ServedModel:
    """One build's tokenizer files, loaded."""

    key: str
    tokenizer: Tokenizer
    chat_template: str | None
    template_source: str
    special: dict[str, str]
    context_len: int | None
    vocab_size: int
    # The deployed build's prompt limit (build.max_input_len, from the package step's limits file); None: unknown.
    max_input_len: int | None = None
    # How the backend serving this build is spoken to ("ensemble" or "llmapi"), as live.json names it; None: the
    # service's own setting (--interface).
    interface: str | None = None
    # The build's LoRA adapters: name → {"task_id": …, "repo_id": …, …} (adapters.json beside the tokenizer files).
    adapters: dict[str, dict] = field(default_factory=dict)
    _bytes: TokenBytes | None = field(default=None, repr=False, compare=False)  # made on first use

    @classmethod
    def load(cls, folder: Path, key: str | None = None) -> ServedModel:
        tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        tok_cfg = _json(folder / "tokenizer_config.json")
        special_map = _json(folder / "special_tokens_map.json")
        special = {}
        for k in SPECIAL_KEYS:
            value = _content(tok_cfg.get(k)) or _content(special_map.get(k))
            if value is not None:
                special[k] = value
        template, source = find_chat_template(folder)
        config = _json(folder / "config.json")
        vocab = config.get("vocab_size") if isinstance(config.get("vocab_size"), int) else None
        if key is None:
            key = hashlib.sha256((folder / "tokenizer.json").read_bytes()).hexdigest()
        limits = _json(folder / LIMITS_FILE)
        deployed = [n for n in (context_length(config), limits.get("max_seq_len")) if isinstance(n, int) and n > 0]
        return cls(key=key, tokenizer=tokenizer, chat_template=template, template_source=source, special=special,
                   # what the deployed engine allows, which may be less than what the model was trained for
                   context_len=min(deployed) if deployed else None,
                   max_input_len=limits.get("max_input_len") if isinstance(limits.get("max_input_len"), int) else None,
                   vocab_size=vocab or tokenizer.get_vocab_size(with_added_tokens=True),
                   adapters=_json(folder / "adapters.json"))

    @property
    def fingerprint(self) -> str:
        return f"fp_{self.key[:12]}"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        # As the repository's postprocessing model: special tokens (a returned stop id) are not text.
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def token_text(self, token: int) -> str:
        """One token as log probs name it: decoded alone, special tokens shown (logprobs.py)."""
        return self.tokenizer.decode([int(token)], skip_special_tokens=False)

    def token_bytes(self, token: int) -> bytes:
        """One token's own bytes (token_bytes.py): part of a character where its text alone reads U+FFFD."""
        if self._bytes is None:
            self._bytes = TokenBytes(self.tokenizer)
        return self._bytes(token, self.token_text(token))

    def chat_ids(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """The prompt's token ids for ``messages``: the chat template, rendered and tokenized."""
        if self.chat_template is None:
            return self.encode(render_chat(FALLBACK_CHAT_TEMPLATE, messages, self.special), add_special_tokens=True)
        return self.encode(render_chat(self.chat_template, messages, self.special, tools), add_special_tokens=False)

    def chat_prompt(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        """The prompt for ``messages`` as text, for a model that tokenizes it itself with its tokenizer's special
        tokens (TensorRT-LLM's LLM API: add_special_tokens defaults to true, and its Triton model has no input
        that changes it). A template that writes the BOS itself loses that BOS here when the tokenizer adds one,
        so the model reads one BOS, as ``chat_ids`` gives; ``encode`` of the result is what the model reads."""
        if self.chat_template is None:
            return render_chat(FALLBACK_CHAT_TEMPLATE, messages, self.special)
        text = render_chat(self.chat_template, messages, self.special, tools)
        bos = self.special.get("bos_token")
        if bos and text.startswith(bos) and self._adds_bos(bos):
            text = text[len(bos):]
        return text

    def _adds_bos(self, bos: str) -> bool:
        bos_id = self.tokenizer.token_to_id(bos)
        return bos_id is not None and self.encode("a", add_special_tokens=True)[:1] == [bos_id]

    def card(self) -> dict:
        """What /v1/models tells about the build (beside OpenAI's fields)."""
        return {"context_length": self.context_len, "chat_template": self.template_source,
                "build": self.fingerprint}


class LiveModel:
    """The build to answer with: a fixed folder, or the one named by ``<state>/live.json`` (followed).

    live.json: ``{"assets": "<folder, relative to state>", "digest": "…", "backend": "…", "interface": "…"}``
    (``interface``: how that backend is spoken to, its ``ai.stoker.interface`` label; absent: the service's own), or
    ``{"error": "…"}`` when stoker could not fetch the live build's files (then every request is a
    503 naming that cause); it is checked (one stat) on every request and reloaded when it changed.
    """

    def __init__(self, folder: Path | None = None, state: Path | None = None) -> None:
        if (folder is None) == (state is None):
            raise ValueError("give exactly one of folder and state")
        self._folder, self._state = folder, state
        self._seen: tuple | None = None
        self._model: ServedModel | None = None
        self._lock = asyncio.Lock()

    def _signature(self) -> tuple | None:
        if self._folder is not None:
            return ("folder",)
        try:
            st = os.stat(self._state / LIVE_FILE)
        except FileNotFoundError:
            return None
        return st.st_ino, st.st_mtime_ns, st.st_size

    def _load(self) -> ServedModel:
        if self._folder is not None:
            return ServedModel.load(self._folder)
        live = _json(self._state / LIVE_FILE)
        if "error" in live:
            raise unavailable(str(live["error"]))
        folder = self._state / live["assets"]
        interface = live.get("interface") or None
        if interface is not None and interface not in INTERFACES:
            raise unavailable(f"the live build's backend speaks an interface this service does not know: {interface!r} "
                              f"(known: {', '.join(INTERFACES)})")
        if self._model is not None and self._model.key == live.get("digest") and self._model.interface == interface:
            return self._model
        model = ServedModel.load(folder, live.get("digest") or None)
        model.interface = interface
        return model

    async def get(self) -> ServedModel:
        """The current build; 503 while no build is live (or its files cannot be read)."""
        sig = self._signature()
        if sig is None:
            raise unavailable("no build is live on this deployment yet")
        if sig != self._seen or self._model is None:
            async with self._lock:
                if sig != self._seen or self._model is None:
                    try:
                        # Off the event loop: a large tokenizer.json takes a moment to parse.
                        self._model = await asyncio.to_thread(self._load)
                    except ApiError:
                        raise
                    except Exception as err:  # noqa: BLE001 - whatever the cause, nothing can be tokenized
                        raise unavailable(f"the live build's tokenizer files cannot be read: {err}") from None
                    self._seen = sig
        return self._model
