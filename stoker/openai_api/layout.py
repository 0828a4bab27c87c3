"""The OpenAI service's state folder, as stoker writes it and the service reads it, and where a model repository
keeps the files it reads (no imports: stoker's deployment code and `stoker bench` use these names without loading
the service)."""

from __future__ import annotations

LIVE_FILE = "live.json"  # {"assets": "assets/<key>", "digest": …, "backend": …} or {"error": …}
# The limits the deployed build enforces (max_seq_len, max_input_len), written by the package step beside the
# engine model's version folder; a checkpoint's config.json gives only what the model was trained for.
LIMITS_FILE = "stoker_limits.json"
# A build's files the service reads: those the reference build writes beside its weights.
ASSET_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
               "chat_template.jinja", "chat_template.json", "config.json", "stoker_runtime.json")
# The LoRA adapters a build serves (stoker/adapters.py's table, in tensorrt_llm/<version>/adapters/): name → task id.
ADAPTERS_TABLE = "adapters/adapters.json"
ENGINE_MODEL = "tensorrt_llm"
# Where each layout keeps its tokenizer, in the order looked at: the reference build's weights and the LLM API's
# checkpoint under the engine model's version folder; a TensorRT-LLM engine folder holds only what trtllm-build
# writes (config.json, rank*.engine: TensorRT-LLM's docs, "trtllm-build" output), so the engine layout's tokenizer
# is preprocessing's copy (tensorrtllm_backend's all_models/inflight_batcher_llm, `tokenizer_dir` parameter).
TOKENIZER_HOMES = (ENGINE_MODEL, "preprocessing")


class NoTokenizer(LookupError):
    pass


def tokenizer_folder(keys) -> tuple[int, str]:
    """From a repository's file keys (relative to its root, "/"-separated): the engine model's newest version and
    the folder that holds the tokenizer.json the service and `stoker bench` read. Pure."""
    engine_versions = [int(k.split("/")[1]) for k in keys if k.startswith(ENGINE_MODEL + "/")
                       and len(k.split("/")) >= 3 and k.split("/")[1].isdigit()]
    for home in TOKENIZER_HOMES:
        found: dict[int, str] = {}
        for key in keys:
            parts = key.split("/")
            if len(parts) >= 4 and parts[0] == home and parts[1].isdigit() and parts[-1] == "tokenizer.json":
                found[int(parts[1])] = "/".join(parts[:-1])
        if found:
            newest = max(found)
            return (max(engine_versions) if engine_versions else newest), found[newest]
    raise NoTokenizer(f"no tokenizer.json under {' or '.join(h + '/<version>/' for h in TOKENIZER_HOMES)} in the "
                      "model repository")
