"""stoker's real ensemble (preprocessing → tensorrt_llm → postprocessing, real tokenizer) with a scripted-timing
``tensorrt_llm``, so both Triton's ensemble and the OpenAI service (which talks to ``tensorrt_llm`` directly) sit
in front of a model whose TTFT and inter-token interval are known.

stoker.bench.scripted scripts the *ensemble* (text in, text out); the OpenAI route needs token ids and a
tokenizer, hence this variant of the same idea. The model keeps TensorRT-LLM's tensor interface (input_ids,
request_output_len, streaming → output_ids, sequence_length): it waits ``first_token_s`` after execute() saw the
request, then streams one token id every ``interval_s`` on an absolute schedule (jitter does not accumulate), then
the empty final response the real model sends. It never stops early (no end id), so output length is exactly
``request_output_len``. The ids cycle through whole-word tokens that decode and re-encode one to one, so a client
counting tokens of the text gets the script's count. With ``timing_log``, each request appends one JSON line
{"recv", "sends"} of server perf_counter stamps, "recv_wall" (time.time(): AIPerf stamps requests on the wall
clock) and "tail", the prompt's last 8 token ids (which prompt it was, whatever the route added in front).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from stoker.bench.workload import WORDS
from stoker.triton.config import RepoSettings
from stoker.triton.repository import TOKENIZER_FILES, assemble

SCRIPT_FILE = "script.json"  # beside model.py: the config.pbtxt stays exactly what stoker renders

MODEL_PY = '''
import json
import os
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def _first(request, name, default=None):
    t = pb_utils.get_input_tensor_by_name(request, name)
    return default if t is None else t.as_numpy().reshape(-1)[0].item()


class TritonPythonModel:
    def initialize(self, args):
        with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "script.json")) as f:
            s = json.load(f)
        self.first, self.interval, self.ids = s["first_token_s"], s["interval_s"], s["token_ids"]
        self.log = s.get("timing_log") or ""
        self.lock = threading.Lock()

    def execute(self, requests):
        # Inputs are read here (their memory may not outlive execute); each request is served by its own thread.
        for request in requests:
            start, wall = time.perf_counter(), time.time()
            count = int(_first(request, "request_output_len"))
            tail = pb_utils.get_input_tensor_by_name(request, "input_ids").as_numpy().reshape(-1)[-8:].tolist()
            streaming = bool(_first(request, "streaming", False))
            args = (start, wall, tail, request.get_response_sender(), count, streaming)
            threading.Thread(target=self._serve, args=args, daemon=True).start()
        return None

    def _tensors(self, ids):
        return [pb_utils.Tensor("output_ids", np.array([[ids]], dtype=np.int32)),
                pb_utils.Tensor("sequence_length", np.array([[len(ids)]], dtype=np.int32))]

    def _serve(self, start, wall, tail, sender, count, streaming):
        sends, ids = [], []
        for k in range(count):
            delay = start + self.first + k * self.interval - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            if sender.is_cancelled():
                break
            ids.append(self.ids[k % len(self.ids)])
            if streaming:
                sends.append(time.perf_counter())
                sender.send(pb_utils.InferenceResponse(output_tensors=self._tensors(ids[-1:])))
        if streaming:
            sender.send(flags=FINAL)
        else:
            sends.append(time.perf_counter())
            sender.send(pb_utils.InferenceResponse(output_tensors=self._tensors(ids)), flags=FINAL)
        if self.log:
            with self.lock, open(self.log, "a") as f:
                f.write(json.dumps({"recv": start, "recv_wall": wall, "tail": tail, "sends": sends}) + "\\n")
'''


def one_to_one_ids(tokenizer_json: Path, count: int = 16) -> list[int]:
    """Ids of whole-word tokens (" word") such that any sequence of them decodes and re-encodes id for id."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    ids = []
    for word in WORDS:
        single = tok.encode(" " + word, add_special_tokens=False).ids
        if len(single) == 1 and single[0] not in ids:
            ids.append(single[0])
        if len(ids) == count:
            break
    # The claim the token counts rest on, checked rather than assumed: a long cycle survives the round trip.
    probe = (ids * 8)[:100]
    if len(ids) < 2 or tok.encode(tok.decode(probe), add_special_tokens=False).ids != probe:
        raise RuntimeError(f"{tokenizer_json}: no set of whole-word tokens round-trips one to one")
    return ids


def write_repo(checkpoint: Path, root: Path, first_token_s: float, interval_s: float,
               timing_log: Path | None = None, settings: RepoSettings | None = None) -> tuple[Path, Path]:
    """The ensemble repository for ``checkpoint``'s tokenizer with a scripted ``tensorrt_llm``.

    Returns (repository, assets): assets is the folder of tokenizer files the OpenAI service reads.
    No weights are needed: the reference build is skipped, and its ``stoker_runtime.json`` (end/pad ids the
    preprocessing model reads) is written here from the tiny model's fixed special ids.
    """
    from stoker.workers.tinymodel import EOS_ID, PAD_ID

    assets = root / "assets"
    assets.mkdir(parents=True)
    for name in (*TOKENIZER_FILES, "config.json"):
        if (checkpoint / name).is_file():
            shutil.copyfile(checkpoint / name, assets / name)
    (assets / "stoker_runtime.json").write_text(json.dumps({"end_id": EOS_ID, "pad_id": PAD_ID, "stop_ids": []}))
    repo = root / "repo"
    for empty in assemble(assets, repo, settings or RepoSettings(model_threads=1)):
        (repo / empty).mkdir(parents=True, exist_ok=True)
    model_dir = repo / "tensorrt_llm" / "1"
    (model_dir / "model.py").write_text(MODEL_PY)
    (model_dir / SCRIPT_FILE).write_text(json.dumps({
        "first_token_s": first_token_s, "interval_s": interval_s,
        "token_ids": one_to_one_ids(assets / "tokenizer.json"), "timing_log": str(timing_log or "")}))
    return repo, assets
