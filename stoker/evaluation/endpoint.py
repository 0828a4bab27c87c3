"""The candidate, scored through its own served endpoint.

Ensemble layout: Triton's `tensorrt_llm` model over gRPC. Token ids go in as they are (no tokenizer round trip), so
the candidate is scored on exactly the positions the baseline was; the connection is the lm-eval adapter's
(lm_eval_client.py).

LLM-API layout (`score_text`): its one model takes and returns text, and has no context logits and no min_tokens.
Each prompt goes in as its decoded text and each greedy answer comes back as text, re-encoded with the build's
tokenizer; the baseline of such a target is measured the same way (its `none` build, served), so both sides of the
agreement went through the same round trip. No perplexity: greedy agreement only.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Callable

from ..protocol import Interface

from .data import EvalSet
from .lm_eval_client import TritonLLMClient
from .metrics import next_token_log_probs, perplexity


def score(grpc_url: str, evalset: EvalSet, log: Callable[[str], None] | None = None,
          context_logits: bool = True, lora_task_id: int | None = None) -> dict:
    """Perplexity over the windows (context logits; None without them) and M greedy tokens per prompt
    (min_tokens = M); ``lora_task_id``: with that LoRA adapter of the build."""
    with TritonLLMClient(grpc_url, lora_task_id=lora_task_id) as client:
        windows = ([next_token_log_probs(client.context_logits(w), w).tolist() for w in evalset.windows]
                   if context_logits else [])
        if log:
            log(f"evaluate: {len(windows)} perplexity windows scored through the endpoint")
        m = evalset.greedy_tokens
        greedy = [client.generate(p, m, min_tokens=m) for p in evalset.prompts]
    return {"window_log_probs": windows, "perplexity": perplexity(windows) if windows else None, "greedy": greedy}


def score_text(http_url: str, evalset: EvalSet, tokenizer_json: Path, interface: Interface,
               log: Callable[[str], None] | None = None, timeout_s: float = 300.0) -> dict:
    """M greedy tokens per prompt through a text-in, text-out model (see the module docstring); no perplexity."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    m = evalset.greedy_tokens
    greedy = []
    for prompt in evalset.prompts:
        body = interface.request(tok.decode(prompt, skip_special_tokens=True), m, streaming=False)
        req = urllib.request.Request(f"{http_url}/v2/models/{interface.model}/generate", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            answer = json.loads(resp.read())
        if "error" in answer:
            raise ValueError(f"{interface.model} answered an error: {str(answer['error']).splitlines()[0]}")
        text = answer.get(interface.text_output, "")
        text = "".join(text) if isinstance(text, list) else str(text)
        greedy.append(tok.encode(text, add_special_tokens=False).ids[:m])
    if log:
        log(f"evaluate: {len(greedy)} prompts answered as text through {interface.model} (greedy agreement only)")
    return {"window_log_probs": [], "perplexity": None, "greedy": greedy}
