"""An OpenAI-compatible API in front of a deployment's Triton `tensorrt_llm` model: the ensemble's (token ids) or
TensorRT-LLM's LLM-API model (text).

    mapping       pure: OpenAI JSON ⇄ Triton tensors, incremental detokenization with stop strings,
                  response bodies, SSE chunks, error bodies
    logprobs      pure: what a request asks of log probs, what each target can answer, OpenAI's log-prob shapes
    token_bytes   pure: a token's own bytes (byte-level BPE, byte fallback) for log probs
    served_model  the live build's tokenizer, chat template and context length, loaded from its files
                  and followed across blue/green switches (live.json, written by stoker)
    app           the ASGI service (FastAPI): one persistent gRPC channel to Triton, one stream per request
    sse           the streamed answer's response: its first chunk ready before the headers go
    http11        uvicorn's h11 protocol writing a streamed answer's headers with its first chunk
    layout        the state folder's names, shared with stoker.serving.openai_service
    __main__      `python -m stoker_openai …` inside the container (uvicorn)

This package runs inside the Triton CPU image, where stoker is not installed: stoker copies it into
the deployment's state folder as the top-level package ``stoker_openai``. So its modules import only
each other (relatively) and what the image has: fastapi, uvicorn, pydantic, grpcio, tritonclient,
numpy, tokenizers, jinja2 and transformers (for its chat-template renderer only).
"""
