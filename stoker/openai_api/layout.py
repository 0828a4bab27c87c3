"""The OpenAI service's state folder, as stoker writes it and the service reads it (no imports: stoker's
deployment code uses these names without loading the service)."""

LIVE_FILE = "live.json"  # {"assets": "assets/<key>", "digest": …, "backend": …} or {"error": …}
# A build's files the service reads: those the reference build writes beside its weights.
ASSET_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
               "chat_template.jinja", "chat_template.json", "config.json", "stoker_runtime.json")
# The LoRA adapters a build serves (stoker/adapters.py's table, in tensorrt_llm/<version>/adapters/): name → task id.
ADAPTERS_TABLE = "adapters/adapters.json"
