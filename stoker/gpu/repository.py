"""Write the Triton model repository of a GPU target (engine/checkpoint files excepted)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from .. import target_traits
from ..atomic import write_atomic
from ..errors import StepError
from ..openai_api.layout import LIMITS_FILE
from ..triton import config as triton_config
from ..triton.models import install_step
from . import inflight, llmapi, tokenizer_info
from .facts import ModelFacts
from .rules import max_seq_len

# chat_template.jinja: where newer models keep their chat template (not in tokenizer_config.json); Triton's
# OpenAI frontend loads its tokenizer from preprocessing's copy (stoker/gpu/openai_frontend.py).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "chat_template.jinja")


def write_repository(spec, facts: ModelFacts | None, out: Path, tokenizer_src: Path | None = None,
                     lora_parameters: dict[str, str] | None = None) -> dict:
    """Configs, python models and tokenizer files into `out`; returns what the package step records.

    Engine target: the engine goes to tensorrt_llm/1/engine/ (the build step's output).
    LLM-API target: the checkpoint goes to tensorrt_llm/1/checkpoint/.
    """
    out.mkdir(parents=True, exist_ok=True)
    write_limits(spec, facts, out)
    if target_traits.of(spec.target).layout == "llmapi":
        stop_ids = facts.stop_ids if facts else ()
        for rel, text in llmapi.render_all(spec, max_seq_len(spec, facts), stop_ids).items():
            (out / rel).parent.mkdir(parents=True, exist_ok=True)
            (out / rel).write_text(text)
        return {"layout": "llmapi", "models": [llmapi.MODEL_NAME], "pending": [f"{llmapi.MODEL_NAME}/1/checkpoint/"]}
    for name, text in inflight.render_all(spec, lora_parameters).items():
        (out / name / "1").mkdir(parents=True, exist_ok=True)
        (out / name / "config.pbtxt").write_text(text)
    ids = {"end_id": facts.end_id if facts else None, "stop_ids": list(facts.stop_ids) if facts else [],
           "pad_id": facts.pad_id if facts else None}
    for step in ("preprocessing", "postprocessing"):
        install_step(step, out / step / "1")
        tok = out / step / "1" / triton_config.RepoSettings().tokenizer_dir
        tok.mkdir(exist_ok=True)
        if tokenizer_src is not None:
            for f in TOKENIZER_FILES:
                if (tokenizer_src / f).is_file():
                    shutil.copyfile(tokenizer_src / f, tok / f)
        if ids["end_id"] is not None:
            # Read first by preprocessing: the end id (Llama 3 Instruct: <|eot_id|>) and every other eos id
            # as stop words (STOP_WORDS_IDS → stop_words_list), so generation stops wherever the model ends.
            (tok / "stoker_runtime.json").write_text(json.dumps(ids, indent=2) + "\n")
    info_rel = inflight.TOKENIZER_INFO_PATH.removeprefix("/models/")
    if tokenizer_src is not None:
        # What the engine's guided decoder is built from (xgrammar_tokenizer_info_path); the stop id is the end id
        # preprocessing sends, so the grammar's way out is the token the engine ends on.
        if not (tokenizer_src / "tokenizer.json").is_file():
            raise StepError(f"guided decoding: {tokenizer_src} has no tokenizer.json to write {info_rel} from")
        text = tokenizer_info.render((tokenizer_src / "tokenizer.json").read_text(encoding="utf-8"), ids["end_id"])
        write_atomic(out / info_rel, text)
    pending = ["tensorrt_llm/1/engine/"]
    if tokenizer_src is None:
        pending += ["preprocessing/1/tokenizer/", "postprocessing/1/tokenizer/", info_rel]
    return {"layout": "inflight_batcher_llm", "models": ["preprocessing", "tensorrt_llm", "postprocessing",
                                                          "ensemble"], "special_ids": ids, "pending": pending}


def write_limits(spec, facts: ModelFacts | None, out: Path) -> None:
    """The limits the deployed build enforces, for the OpenAI service (a prompt over max_input_len, or prompt plus
    completion over max_seq_len, is a 400 there instead of a failed request at the engine)."""
    limits = {"max_seq_len": max_seq_len(spec, facts), "max_input_len": spec.build.max_input_len}
    (out / triton_config.MODEL_NAME / "1").mkdir(parents=True, exist_ok=True)
    (out / triton_config.MODEL_NAME / "1" / LIMITS_FILE).write_text(json.dumps(limits) + "\n")
