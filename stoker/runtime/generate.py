"""Token-by-token generation over the reference model (transformers' model class, our loop).

Our own loop rather than transformers' `generate`: each token must leave as soon as it is
sampled (one streamed response per token), and TensorRT-LLM's request semantics below differ
from transformers' in details (end_id is not returned, stop words are, min_tokens holds back
end_id only). The logits are the model's own, so greedy output equals transformers' greedy
`generate` token for token.

End token: like TensorRT-LLM, `end_id` is never yielded. Its sampling kernels set the
"finished" state without increasing the sequence length when the end id is sampled ("Seq len
should always contain only tokens to be outputted"), so neither streamed responses nor the
final output_ids/sequence_length carry it. A generation that ends on end_id therefore yields
fewer than max_new_tokens tokens.

Stop words (TensorRT-LLM's stop_words_list: every eos id other than end_id travels as one): a
generation ends once its sequence ends with one of them, and, as in TensorRT-LLM, the matched
word is yielded. `min_new_tokens` holds back end_id only, as TensorRT-LLM's min length does.

Sampling semantics of this function (the Triton model maps TensorRT-LLM's request fields onto
them): temperature <= 0 or top_k == 1 is greedy (argmax); otherwise logits / temperature,
then top_k (0 = no limit), then top_p (nucleus; 1.0 = no limit). Repetition penalty follows
the CTRL/HF rule over prompt and generated tokens: positive logits divided by it, negative
ones multiplied.

Embedding bias, presence and frequency penalties follow TensorRT-LLM's penalty kernel
(cpp/tensorrt_llm/kernels/penaltyKernels.cu, batchApplyPenalty), which is what the engine runs for its
embedding_bias, presence_penalty and frequency_penalty inputs: the bias ([vocab], added to every step's
logits) comes first, then the temperature, then, for each token that occurs n > 0 times in the sequence
so far, the presence penalty is subtracted once and the frequency penalty n times. "The sequence so far"
is the prompt and the generated tokens, as the kernel counts them (its context phase counts the input
ids; TensorRT-LLM's optional promptIgnoreLength, which excludes the prompt, is not an input of 1.2.1's
Triton model). OpenAI's definition counts generated tokens only: through this runtime, as through the
engine, a token of the prompt is penalised too. Because the penalties come after the temperature, a
sampled token sees logits (z + bias) / T - penalties; a greedy one sees z + bias - penalties (greedy
ignores the temperature, below).

Log probabilities (TensorRT-LLM's output_log_probs / cum_log_probs; a `Record` passed to
`generate` collects them): each token's log prob is taken from the distribution it was chosen
from, as TensorRT-LLM reports the sampled token's log prob from the processed logits: the
log-softmax of the logits after the embedding bias, the penalties (repetition, presence, frequency),
the min_tokens mask and, when sampling, the temperature, over the whole vocabulary (before top-k/top-p truncation). Greedy decoding
ignores the temperature, so a greedy token's log prob is the log-softmax of the model's own
logits (biased and penalised when asked). The end id is not yielded, so its log prob is not recorded either: the cumulative log
prob is the sum of the recorded ones. Context logits are the prompt's logits from the prefill,
[prompt_len, vocab], the model's raw output.

Top log probs (`Record.top_log_probs` = k > 0; stoker's own, for the OpenAI service's `top_logprobs`:
TensorRT-LLM 1.2.1's Triton model has no such output): the k largest entries of the same log-softmax row the
sampled token's log prob is read from, as (token id, log prob), most likely first, one list per yielded token.
Guided decoding (TensorRT-LLM's guided_decoding_guide inputs): a `constraint` (stoker_runtime.guided.Constraint)
masks the logits after the repetition penalty and the min_tokens mask, before the token is drawn, and is told the
token; when it allows no token the generation ends there, as at the end id. Log probs are then those of the masked
distribution, as the engine's are of the logits it samples from.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .model import ReferenceModel


def _ends_with(sequence: list[int], words: list[list[int]]) -> bool:
    # Same rule as triton_models/stop_words.py; repeated here so the runtime package stays self-contained.
    return any(len(w) <= len(sequence) and sequence[-len(w):] == w for w in words)


@dataclass
class Record:
    """What a generation reports besides its tokens, filled while it runs (see the module docstring)."""

    want_log_probs: bool = True
    want_context_logits: bool = False
    top_log_probs: int = 0  # k alternatives per token (with want_log_probs); 0: none
    log_probs: list[float] = field(default_factory=list)  # one per yielded token
    top: list[list[tuple[int, float]]] = field(default_factory=list)  # per yielded token, its k (id, log prob)
    context_logits: torch.Tensor | None = None  # [prompt_len, vocab], after the prefill

    @property
    def cum_log_prob(self) -> float:
        return float(sum(self.log_probs))


def token_log_probs(logits: torch.Tensor, tokens: Sequence[int]) -> torch.Tensor:
    """log_softmax(logits[i])[tokens[i]] for each row: logits [N, vocab], tokens N ids → [N] float32.

    Also a prompt's log probabilities from its context logits: token_log_probs(context_logits[:-1], prompt[1:]).
    """
    rows = torch.log_softmax(logits.float(), dim=-1)
    return rows[torch.arange(len(tokens)), torch.as_tensor(list(tokens), dtype=torch.long)]


def _processed(logits: torch.Tensor, temperature: float, top_k: int) -> torch.Tensor:
    """The logits the token is drawn from, before truncation: divided by the temperature unless greedy."""
    if temperature <= 0.0 or top_k == 1:
        return logits
    return logits / temperature


def _apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    picked = logits[seen]
    logits = logits.clone()
    logits[seen] = torch.where(picked > 0, picked / penalty, picked * penalty)
    return logits


def _apply_additive_penalties(logits: torch.Tensor, counts: torch.Tensor, presence: float, frequency: float,
                               scale: float) -> torch.Tensor:
    """Subtract ``presence`` once and ``frequency`` per occurrence from every token that occurred (counts > 0).

    ``scale``: the temperature the logits are divided by afterwards (1.0 when greedy). TensorRT-LLM subtracts after
    dividing by it; subtracting ``scale`` times the penalty first gives the same logits after the division."""
    occurred = counts > 0
    penalty = (presence * occurred.to(logits.dtype) + frequency * counts.to(logits.dtype)) * scale
    return logits - penalty


def sample_next(
    logits: torch.Tensor,
    temperature: float,
    top_k: int,
    top_p: float,
    generator: torch.Generator | None,
) -> int:
    """Pick the next token id from 1-D `logits`."""
    if temperature <= 0.0 or top_k == 1:
        return int(torch.argmax(logits))
    logits = logits / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token once the tokens ranked above it already cover top_p; the first survives.
        drop = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        drop[0] = False
        logits = logits.clone()
        logits[order[drop]] = float("-inf")
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def generate(
    model: ReferenceModel,
    input_ids: Sequence[int],
    max_new_tokens: int,
    end_id: int,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    repetition_penalty: float = 1.0,
    seed: int | None = None,
    min_new_tokens: int = 0,
    stop_words: Sequence[Sequence[int]] = (),
    record: Record | None = None,
    adapter: str | None = None,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    embedding_bias: torch.Tensor | Sequence[float] | None = None,
) -> Iterator[int]:
    """Yield generated token ids one at a time: prefill the prompt, then decode with the cache.

    Stops after `max_new_tokens`, when `end_id` is sampled (not yielded), or when the sequence
    reaches the model's max_position_embeddings. Raises ValueError at call time (before any
    compute) for an empty or too long prompt, out-of-vocabulary ids or invalid sampling
    settings. `seed` makes sampling reproducible; None draws a fresh random seed. `min_new_tokens`
    (TensorRT-LLM's min_tokens) keeps `end_id` from being sampled before that many tokens.
    `stop_words` (token id sequences) end the generation after the token that completes one.
    `record`, when given, collects each yielded token's log prob and/or the prompt's context logits.
    `adapter`: the LoRA adapter (by name) the whole sequence runs with; None: the base model.
    `presence_penalty`, `frequency_penalty`, `embedding_bias` ([vocab] floats added to the logits): TensorRT-LLM's,
    as the module docstring says; 0, 0 and None change nothing.
    """
    return _run(start(model, input_ids, max_new_tokens, end_id, temperature, top_k, top_p, repetition_penalty,
                      seed, min_new_tokens, stop_words, record, adapter, presence_penalty=presence_penalty,
                      frequency_penalty=frequency_penalty, embedding_bias=embedding_bias))


def start(
    model: ReferenceModel,
    input_ids: Sequence[int],
    max_new_tokens: int,
    end_id: int,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    repetition_penalty: float = 1.0,
    seed: int | None = None,
    min_new_tokens: int = 0,
    stop_words: Sequence[Sequence[int]] = (),
    record: Record | None = None,
    adapter: str | None = None,
    constraint: Any = None,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    embedding_bias: torch.Tensor | Sequence[float] | None = None,
) -> Decoding:
    """Validate a generation (as `generate` does, raising ValueError) and return its state, before any compute."""
    prompt = [int(t) for t in input_ids]
    if not prompt:
        raise ValueError("input_ids is empty")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if len(prompt) >= model.max_positions:
        raise ValueError(f"prompt of {len(prompt)} tokens leaves no room within max_position_embeddings {model.max_positions}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0, got {top_k}")
    if repetition_penalty <= 0.0:
        raise ValueError(f"repetition_penalty must be > 0, got {repetition_penalty}")
    model.lora.resolve(adapter)  # an unknown adapter fails here, before any compute
    vocab = model.vocab_size
    if min(prompt) < 0 or max(prompt) >= vocab:
        raise ValueError(f"input_ids must lie in 0..{vocab - 1}")
    bias = None
    if embedding_bias is not None:
        bias = torch.as_tensor(embedding_bias, dtype=torch.float32).reshape(-1)
        if bias.numel() != vocab:
            raise ValueError(f"embedding_bias has {bias.numel()} values; the vocabulary has {vocab}")
        if not bool(torch.isfinite(bias).all()):
            raise ValueError("embedding_bias holds a value that is not finite")
    for name, value in (("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)):
        if value != value or value in (float("inf"), float("-inf")):
            raise ValueError(f"{name} must be finite, got {value}")
    words = [[int(t) for t in w] for w in stop_words if len(w)]
    budget = min(max_new_tokens, model.max_positions - len(prompt))
    generator = torch.Generator().manual_seed(seed if seed is not None else secrets.randbits(63))
    decoding = Decoding(model, prompt, budget, end_id, temperature, top_k, top_p, repetition_penalty, generator,
                        min_new_tokens, words, record, adapter)
    decoding.constraint = constraint
    decoding.presence_penalty, decoding.frequency_penalty = float(presence_penalty), float(frequency_penalty)
    decoding.embedding_bias = bias
    return decoding


class Decoding:
    """One sequence between forward passes: its cache, the logits of its next position, and its sampling state.

    The step logic of `generate`, kept apart from the forward passes so a scheduler can run one
    sequence's forwards batched with others' (stoker_runtime.batch): `prefill()` once, then
    `choose()` picks the next token from the current logits (None: end_id was sampled, not yielded)
    and `done` says whether the sequence ended with it; otherwise the chosen token (`pending`) goes
    through the model with this sequence's `cache` and `feed()` takes the logits it produced.
    """

    def __init__(self, model: ReferenceModel, prompt: list[int], budget: int, end_id: int, temperature: float,
                 top_k: int, top_p: float, repetition_penalty: float, generator: torch.Generator,
                 min_new_tokens: int = 0, stop_words: list[list[int]] | None = None,
                 record: Record | None = None, adapter: str | None = None) -> None:
        self.model = model
        self.prompt = prompt
        self.budget = budget
        self.end_id = end_id
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.repetition_penalty = repetition_penalty
        self.generator = generator
        self.min_new_tokens = min_new_tokens
        self.stop_words = stop_words or []
        self.record = record
        self.adapter = adapter
        self.cache: Any = None
        self.logits: torch.Tensor | None = None  # of the next position
        self.pending: int | None = None  # chosen and yielded, not yet through the model
        self.step = 0
        self.done = False
        # Guided decoding (stoker_runtime.guided.Constraint): masks the logits before each choice, sees each token.
        self.constraint: Any = None
        # TensorRT-LLM's embedding_bias, presence_penalty and frequency_penalty (set by `start`; off by default).
        self.embedding_bias: torch.Tensor | None = None
        self.presence_penalty = 0.0
        self.frequency_penalty = 0.0
        self.counts: torch.Tensor | None = None  # occurrences per token id in the sequence, when a penalty needs them

    def prefill(self) -> None:
        self.cache = self.model.new_cache(self.adapter)
        self.seen = torch.zeros(self.model.vocab_size, dtype=torch.bool)
        self.seen[torch.tensor(self.prompt)] = True
        if self.presence_penalty or self.frequency_penalty:
            self.counts = torch.bincount(torch.tensor(self.prompt), minlength=self.model.vocab_size)
        self.sequence = list(self.prompt)  # stop words may reach back into the prompt, as TensorRT-LLM's do
        context = self.model.forward(self.prompt, self.cache)
        if self.record is not None and self.record.want_context_logits:
            self.record.context_logits = context
        self.logits = context[-1]

    def feed(self, logits: torch.Tensor) -> None:
        """The logits the model gave for `pending` (the next position's)."""
        self.logits = logits
        self.pending = None

    def choose(self) -> int | None:
        """The next token to yield, or None when end_id was sampled; `done` is then set when it ends the sequence."""
        logits = self.logits
        self.logits = None
        if self.embedding_bias is not None:  # first, as in TensorRT-LLM's kernel: before temperature and penalties
            logits = logits + self.embedding_bias.to(logits.dtype)
        if self.repetition_penalty != 1.0:
            logits = _apply_repetition_penalty(logits, self.seen, self.repetition_penalty)
        if self.counts is not None:
            greedy = self.temperature <= 0.0 or self.top_k == 1
            logits = _apply_additive_penalties(logits, self.counts, self.presence_penalty, self.frequency_penalty,
                                               1.0 if greedy else self.temperature)
        if self.step < self.min_new_tokens and 0 <= self.end_id < logits.shape[-1]:
            logits = logits.clone()
            logits[self.end_id] = float("-inf")  # too early to end
        if self.constraint is not None:
            logits = self.constraint.mask(logits)
            if logits is None:  # no token can follow: the sequence ends here, as at an end id
                self.done = True
                return None
        token = sample_next(logits, self.temperature, self.top_k, self.top_p, self.generator)
        if token == self.end_id:
            self.done = True
            return None
        if self.record is not None and self.record.want_log_probs:
            self._score(logits, token)
        if self.constraint is not None:
            self.constraint.accept(token)
        self.sequence.append(token)
        if self.counts is not None:
            self.counts[token] += 1
        self.step += 1
        if self.step == self.budget or (self.stop_words and _ends_with(self.sequence, self.stop_words)):
            self.done = True
        else:
            self.seen[token] = True
            self.pending = token
        return token

    def _score(self, logits: torch.Tensor, token: int) -> None:
        """Record ``token``'s log prob and, when asked, the top k of the same row (one log-softmax for both)."""
        rows = torch.log_softmax(_processed(logits, self.temperature, self.top_k), dim=-1)
        # The top k first: the batcher's sender thread reads `top` by the position of `log_probs`.
        if self.record.top_log_probs:
            values, ids = torch.topk(rows, min(self.record.top_log_probs, rows.shape[-1]))
            self.record.top.append(list(zip(ids.tolist(), values.tolist())))
        self.record.log_probs.append(float(rows[token]))


def _run(decoding: Decoding) -> Iterator[int]:
    """One sequence alone: each token leaves before the next forward pass."""
    decoding.prefill()
    while True:
        token = decoding.choose()
        if token is None:
            return
        yield token
        if decoding.done:
            return
        decoding.feed(decoding.model.forward([decoding.pending], decoding.cache)[-1])
