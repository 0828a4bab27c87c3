"""The candidate, scored through its own served endpoint: Triton's `tensorrt_llm` model over gRPC.

Token ids go in as they are (no tokenizer round trip), so the candidate is scored on exactly the
positions the baseline was; the connection is the lm-eval adapter's (lm_eval_client.py).
"""

from __future__ import annotations

from typing import Callable

from .data import EvalSet
from .lm_eval_client import TritonLLMClient
from .metrics import next_token_log_probs, perplexity


def score(grpc_url: str, evalset: EvalSet, log: Callable[[str], None] | None = None,
          context_logits: bool = True) -> dict:
    """Perplexity over the windows (context logits; None without them) and M greedy tokens per prompt
    (min_tokens = M)."""
    with TritonLLMClient(grpc_url) as client:
        windows = ([next_token_log_probs(client.context_logits(w), w).tolist() for w in evalset.windows]
                   if context_logits else [])
        if log:
            log(f"evaluate: {len(windows)} perplexity windows scored through the endpoint")
        m = evalset.greedy_tokens
        greedy = [client.generate(p, m, min_tokens=m) for p in evalset.prompts]
    return {"window_log_probs": windows, "perplexity": perplexity(windows) if windows else None, "greedy": greedy}
