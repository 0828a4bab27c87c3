"""A token's own bytes, for the ``bytes`` of OpenAI's log probs: what lets a client join the tokens of a character
that several tokens share (its text alone reads U+FFFD). Pure.

Two vocabularies store bytes a token's decoded text cannot show:
- byte-level BPE (GPT-2, Llama 3, Qwen2, stoker's tiny model): every byte is written as one printable character,
  the 188 printable Latin-1 bytes as themselves and the other 68, in order, as U+0100 onwards;
- SentencePiece with byte fallback (Llama 2, Mistral): a byte with no piece of its own is the token ``<0xNN>``.
Any other token's bytes are its decoded text's UTF-8.
"""

from __future__ import annotations

import re
from functools import lru_cache

from tokenizers import Tokenizer, decoders

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@lru_cache(maxsize=1)
def byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's character for each byte, inverted: character → byte."""
    shown = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    hidden = [b for b in range(256) if b not in shown]
    out = {chr(b): b for b in shown}
    out.update({chr(256 + i): b for i, b in enumerate(hidden)})
    return out


class TokenBytes:
    """One tokenizer's tokens as bytes (see the module docstring)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.byte_level = isinstance(tokenizer.decoder, decoders.ByteLevel)
        # Added tokens (the special ones among them) are stored as their text, whatever the vocabulary's kind.
        self.added = frozenset(tokenizer.get_added_tokens_decoder())

    def __call__(self, token: int, text: str) -> bytes:
        """``token``'s bytes; ``text``: its decoded text (the answer for a token stored as text)."""
        piece = self.tokenizer.id_to_token(int(token))
        if piece is not None and int(token) not in self.added:
            if self.byte_level:
                alphabet = byte_level_alphabet()
                if all(c in alphabet for c in piece):
                    return bytes(alphabet[c] for c in piece)
            elif (found := _BYTE_PIECE.fullmatch(piece)) is not None:
                return bytes([int(found.group(1), 16)])
        return text.encode("utf-8")
