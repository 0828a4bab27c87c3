"""Seeded synthetic prompts with exact input lengths, measured by the served model's tokenizer.

GenAI-Perf's synthetic default is a fixed ISL with stddev 0; we do the same: every prompt has exactly
`input_tokens` tokens (special tokens excluded unless asked), built from random words so that no prompt
is a prefix of another (which would flatter a server with prefix caching). With a stddev, each prompt's
length is drawn from a normal distribution (rounded, at least 1) and then hit exactly. Output lengths
work the same way and travel with the prompt as its `max_tokens`. Prompt files (JSONL) are the
alternative: one object per line with "text" (or "text_input"), optionally "output_tokens".
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .errors import InvalidBenchmarkConfig

# Plain English words; short ones first so the greedy filler finds one-token words in any BPE vocabulary.
WORDS: tuple[str, ...] = tuple(
    """
    a I an as at be by do go he if in is it me my no of on or so to up us we
    all and any are big but can car day did end far few for get got had has her him his how its let
    man may new not now old one our out own put red run say see set she sun the too two use war was
    way who why yes yet you able also area back bank bird blue boat body book both call came city
    cold come cost dark data deep door down draw each east easy even face fact fall farm fast fear
    fill find fire fish five food foot form four free from full game give gold good gray grow hair
    half hand hard head hear heat help here high hill hold home hope hour idea into iron just keep
    kind king land last late lead left less life light line list live long look lost love made make
    many mark meet mile mind miss more most move much must name near need next nice nine none north
    note once only open over page pair part pass past path plan play poor port pull rain read real
    rest rich ride ring rise road rock role room rule safe said salt same sand save seat seed seem
    self sell send ship shop show side sign sing size skin slow snow soft soil some song soon sort
    star stay step stop such sure take talk tall team tell test than that them then they thin this
    time tone tree trip true turn type unit upon very view wait walk wall want warm wash wave weak
    wear week well went west what when whom wide wife wild will wind wine wing wire wise wish with
    wood word work yard year zero above about after again along among apple basic beach begin being
    below birth black board bread break bring brown build carry catch cause chain chair chart check
    child clean clear clock close cloud coast could count cover cross crowd dance doubt dream drink
    drive early earth eight enjoy enter equal event every exact field fight final first floor focus
    force fresh front fruit glass grain grass great green group guard guess happy heart heavy horse
    house human issue judge known large later laugh layer learn level light local lower lucky major
    march match metal might model money month motor mouth music never night noise north ocean offer
    order other owner paint paper party peace phone piece place plain plane plant point power press
    price proud queen quick quiet radio raise range reach ready right river round route royal scale
    scene score sense serve seven shape share sharp sheet shelf shell shift shine short sight since
    skill sleep small smile smoke solid sound south space speak speed spend sport staff stage stand
    start state steam steel stick still stone store storm story study sugar table teach thank their
    there thick thing think third three throw tight today total touch tower track trade train truth
    under until upper usual value visit voice watch water wheel where which while white whole woman
    world worry would write wrong young
    """.split()  # noqa: SIM905 -- a word list reads better as text
)


@dataclass(frozen=True)
class Prompt:
    text: str
    input_tokens: int
    output_tokens: int | None = None  # this prompt's max_tokens; None: the run's default


class PromptFileError(InvalidBenchmarkConfig):
    """A prompt file that cannot be read as JSONL prompts."""


def sample_lengths(count: int, mean: int, stddev: float, rng: random.Random) -> list[int]:
    """`count` lengths ~ N(mean, stddev), rounded and at least 1; exactly `mean` when stddev is 0."""
    if stddev < 0:
        raise ValueError(f"stddev must be >= 0, got {stddev}")
    if stddev == 0:
        return [mean] * count
    return [max(1, round(rng.gauss(mean, stddev))) for _ in range(count)]


def token_counter(tokenizer_json: Path, add_special_tokens: bool = False) -> Callable[[str], int]:
    """A function counting tokens of a text with a `tokenizer.json` (also usable as the client's OSL counter)."""
    from tokenizers import Tokenizer  # imported here: callers without a tokenizer need not load it

    tokenizer = Tokenizer.from_file(str(tokenizer_json))

    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    return count


def make_prompts(
    count: int,
    input_tokens: int,
    seed: int,
    tokenizer_json: Path | None = None,
    add_special_tokens: bool = False,
    input_stddev: float = 0.0,
    output_tokens: int | None = None,
    output_stddev: float = 0.0,
) -> list[Prompt]:
    """`count` distinct prompts of exactly the drawn number of tokens each, identical for identical arguments.

    Without a tokenizer the length is counted in words, and `Prompt.input_tokens` is that nominal count.
    With `output_tokens`, each prompt carries its own max_tokens (drawn with `output_stddev`).
    Raises ValueError for non-positive sizes or when the tokenizer cannot hit the length exactly.
    """
    if count < 0:
        raise ValueError(f"prompt count must be >= 0, got {count}")
    if input_tokens < 1:
        raise ValueError(f"input_tokens must be >= 1, got {input_tokens}")
    if output_tokens is not None and output_tokens < 1:
        raise ValueError(f"output_tokens must be >= 1, got {output_tokens}")
    rng = random.Random(seed)
    # Lengths come from their own stream, so stddev 0 gives the very prompts it always gave.
    lengths_rng = random.Random(f"lengths-{seed}")
    isl = sample_lengths(count, input_tokens, input_stddev, lengths_rng)
    osl: list[int | None] = (
        [None] * count if output_tokens is None else list(sample_lengths(count, output_tokens, output_stddev, lengths_rng))
    )
    if tokenizer_json is None:
        return [Prompt(" ".join(rng.choices(WORDS, k=n)), n, o) for n, o in zip(isl, osl)]
    counter = token_counter(tokenizer_json, add_special_tokens=add_special_tokens)
    prompts: list[Prompt] = []
    seen: set[str] = set()
    while len(prompts) < count:
        n, o = isl[len(prompts)], osl[len(prompts)]
        text = _exact_text(rng, n, counter)
        if text not in seen:  # tiny lengths can repeat by chance; keep prompts distinct
            seen.add(text)
            prompts.append(Prompt(text, n, o))
    return prompts


def load_prompt_file(path: Path, tokenizer_json: Path | None = None, add_special_tokens: bool = False) -> list[Prompt]:
    """Prompts from a JSONL file, ISL measured with the tokenizer (words without one).

    Each line: {"text": "..."} (GenAI-Perf's input-file form; "text_input" is accepted too), optionally
    "output_tokens" (that prompt's max_tokens). Blank lines are skipped. Raises PromptFileError, one line.
    """
    count = token_counter(tokenizer_json, add_special_tokens) if tokenizer_json else (lambda t: len(t.split()))
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise PromptFileError(f"prompt file {path}: {exc.strerror or exc}") from None
    prompts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise PromptFileError(f"prompt file {path} line {number}: not JSON ({exc.msg})") from None
        text = obj.get("text", obj.get("text_input")) if isinstance(obj, dict) else None
        if not isinstance(text, str) or not text:
            raise PromptFileError(f"prompt file {path} line {number}: needs a non-empty \"text\" string")
        osl = obj.get("output_tokens")
        if osl is not None and (not isinstance(osl, int) or osl < 1):
            raise PromptFileError(f"prompt file {path} line {number}: output_tokens must be an integer >= 1")
        prompts.append(Prompt(text, count(text), osl))
    if not prompts:
        raise PromptFileError(f"prompt file {path} holds no prompts")
    return prompts


def _join(words: list[str]) -> str:
    return " ".join(words)


def _exact_text(rng: random.Random, target: int, count: Callable[[str], int]) -> str:
    """Random words cut to the longest prefix within `target` tokens, then topped up word by word."""
    # Every word costs at least one token, so `target` words are never too few.
    words = rng.choices(WORDS, k=target)
    lo, hi = 0, target  # invariant: the first `lo` words fit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count(_join(words[:mid])) <= target:
            lo = mid
        else:
            hi = mid - 1
    words = words[:lo]
    used = count(_join(words))
    # Token counts are usually additive across spaces, but merges and special tokens make that a
    # hope, not a rule: re-measure the whole text after each added word.
    while used < target:
        candidates = list(WORDS)
        rng.shuffle(candidates)
        for word in candidates:
            trial = count(_join(words + [word]))
            if used < trial <= target:
                words.append(word)
                used = trial
                break
        else:
            raise ValueError(f"cannot build a prompt of exactly {target} tokens with this tokenizer")
    return _join(words)
