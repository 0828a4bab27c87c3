"""Triton python-backend `tensorrt_llm` model: the CPU reference stand-in for TensorRT-LLM.

It speaks the tensor interface of TensorRT-LLM's `tensorrt_llm` model so the same ensemble
serves either, but generates with stoker's float32 reference runtime (copied next to this file
as the `stoker_runtime` package) from the reference artifact in `gpt_model_path`: transformers'
own model class for the artifact's architecture, our dequantized weights, our KV-cache rounding
and our token-by-token loop.

Inputs (leading batch dim): input_ids INT32 [-1], input_lengths INT32 [1], request_output_len
INT32 [1]; optional end_id, pad_id INT32 [1], streaming BOOL [1], temperature FP32 [1],
runtime_top_k INT32 [1], runtime_top_p FP32 [1], repetition_penalty FP32 [1], seed UINT64 [1],
presence_penalty FP32 [1], frequency_penalty FP32 [1], embedding_bias FP32 [vocab] (added to the logits; penalties
and bias as TensorRT-LLM's kernel applies them: stoker_runtime.generate's docstring),
exclude_input_in_output BOOL [1], min_tokens INT32 [1] (end_id cannot end the output before that many tokens),
stop_words_list INT32 [2, -1] (TensorRT-LLM's layout, see stoker_stop_words.py),
return_log_probs BOOL [1], return_context_logits BOOL [1], return_top_log_probs INT32 [1] (stoker's own, the
reference target's only: k alternatives per generated token, 0..20, implies return_log_probs; TensorRT-LLM 1.2.1's
model has no such input), lora_task_id UINT64 [1] (TensorRT-LLM's per-request
adapter: one of the LoRA adapters the repository carries in 1/adapters/, listed with their task ids in
adapters.json; an id it does not carry fails that request alone, naming the served ones),
guided_decoding_guide_type STRING [1] and guided_decoding_guide STRING [1] (TensorRT-LLM's guided decoding: json,
json_schema, regex or ebnf_grammar, enforced per token with xgrammar by stoker_runtime.guided; a guide that does not
compile fails that request alone before it is queued, its message naming guided_decoding_guide).
Outputs: output_ids INT32 [-1, -1] (beam, tokens), sequence_length INT32 [-1] (per beam); only
when asked (as TensorRT-LLM): cum_log_probs FP32 [-1] (per beam) and output_log_probs FP32
[-1, -1] (beam, generated tokens; zero-padded) for return_log_probs, context_logits FP32
[-1, -1] (prompt tokens, vocab; zero-padded across a batch) for return_context_logits; for return_top_log_probs
k, top_log_prob_ids INT32 [-1, -1] and top_log_probs FP32 [-1, -1] (generated tokens, k; most likely first). Log probs
are those of the distribution each token was sampled from (stoker_runtime.generate's docstring);
prompt log probabilities are read from context_logits (generate.token_log_probs), as TensorRT-LLM's
Triton interface has no tensor of its own for them.
Parameters: gpt_model_path (default "weights", relative to the version dir unless absolute),
num_threads (torch threads, default 2), max_concurrent_requests (sequences decoded together; default the
config's max_batch_size, as TensorRT-LLM's engine batch bounds its in-flight batcher; 8 without one),
exclude_input_in_output (default "false", as upstream), lora_prefetch_dir (adapters in TensorRT-LLM's format, one
folder per task id, named by the adapters table: stoker/runtime/lora_trtllm.py), tokenizer_dir (the tokenizer guides
are compiled against, upstream's parameter of that name; default the weights folder, where the reference build
writes it), guided_decoding_backend and xgrammar_tokenizer_info_path (upstream's: with both set, guides are compiled
against that file, TensorRT-LLM's xgrammar tokenizer info, and tokenizer_dir is not used; the engine repository
renders them, so its stand-in enforces guides from the file a real engine reads).

Behaviour, matched to TensorRT-LLM where it defines one:
- Streaming (decoupled only): one response per generated token, output_ids [1, 1, 1] and
  sequence_length [1, 1] = 1 (and, when asked, that token's output_log_probs [1, 1, 1], the
  running cum_log_probs [1, 1], its top_log_prob_ids / top_log_probs [1, 1, k], and context_logits with the first
  response), then an empty
  response flagged COMPLETE_FINAL. Streamed tokens
  never include the prompt. Streaming takes one sequence per request (batch 1).
- Non-streaming: one response, output_ids [batch, 1, T] right-padded with pad_id, and
  sequence_length; the prompt is included unless exclude_input_in_output.
- The end id is never returned and not counted in sequence_length.
- Sampling: no runtime_top_k and no runtime_top_p (or both 0) is greedy, whatever the
  temperature; otherwise temperature (default 1.0) with top-k / top-p. top_p <= 0 means unset.
  seed defaults to 0, so repeated identical sampled requests give identical output.
- end_id / pad_id default to the artifact's stoker_runtime.json, and so do the stop words when
  the request has no stop_words_list (its `stop_ids`: the model's other eos ids). A matched stop
  word is returned and counted, as TensorRT-LLM does; an empty list means no stop words.
Concurrency: in-flight batching (stoker_runtime.batch). execute only hands requests to threads that
submit their sequences to one scheduler thread; it decodes one token of every running sequence per
model pass and admits waiting sequences (prefilled one by one) between passes, up to
max_concurrent_requests; more wait in arrival order. Each token is sent as soon as its pass ends. A
sequence is validated before it is queued, so an invalid or over-long one is refused alone. Greedy
ids are those of the sequence alone. With max_concurrent_requests 1, requests run one after another.
Cancelled requests stop at the next token (or before their prefill, while waiting); the others'
outputs do not change. Every failure is answered as a TritonError response.
In flight: the gauge stoker_requests_in_flight{model="tensorrt_llm"} on Triton's metrics port counts requests
begun and not yet answered (TensorRT-LLM's backend reports nv_trt_llm_request_metrics{request_type="active"});
stoker retires a drained backend whose clients keep idle gRPC streams open once it reads 0 there.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

# The runtime is shipped beside this file as a plain package (no stoker install in Triton).
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from stoker_stop_words import from_word_list
from stoker_runtime.batch import DEFAULT_MAX_BATCH, Batcher, Stream
from stoker_runtime.generate import Record
from stoker_runtime.guided import GUIDE_INPUT, GUIDE_TYPE_INPUT, Grammars, GuideError, parse_guide
from stoker_runtime.model import RUNTIME_FILE, load_model

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
MAX_TOP_LOG_PROBS = 20  # OpenAI's bound on top_logprobs: alternatives a token may carry


class RequestError(ValueError):
    """The request is invalid; its message goes back to the client."""


class Cancelled(Exception):
    """The client cancelled the request or the model is shutting down."""


def _param(model_config: dict[str, Any], name: str, default: str) -> str:
    value = model_config.get("parameters", {}).get(name, {}).get("string_value", "")
    if value == "" or value.startswith("${"):
        return default
    return value


def _tokenizer_info_path(model_config: dict[str, Any]) -> Path | None:
    """The xgrammar tokenizer info file guides are compiled against, read as TensorRT-LLM's C++ backend reads its
    parameters (tensorrtllm_backend inflight_batcher_llm/src/model_instance_state.cc,
    getGuidedDecodingConfigFromParams; docs/guided_decoding.md): used only with guided_decoding_backend set too;
    a backend other than xgrammar, or a file that does not exist, fails the model's load. None: tokenizer_dir."""
    backend = _param(model_config, "guided_decoding_backend", "")
    path = _param(model_config, "xgrammar_tokenizer_info_path", "")
    if not backend or not path:
        return None
    if backend != "xgrammar":
        raise ValueError(f"guided_decoding_backend {backend!r}: only 'xgrammar' is supported, as TensorRT-LLM's")
    if not Path(path).is_file():
        raise ValueError(f"xgrammar_tokenizer_info_path {path} does not exist")
    return Path(path)


def _scalar(request: Any, name: str, batch: int, index: int) -> Any:
    """Item `index` of an optional [batch, 1] input, as a Python scalar (None when absent)."""
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return None
    values = tensor.as_numpy().reshape(-1)
    if values.size != batch:
        raise RequestError(f"{name} has {values.size} values for a batch of {batch}")
    value = values[index]
    # Triton hands BYTES tensors over as numpy object arrays of Python bytes, which have no .item().
    return value.item() if hasattr(value, "item") else value


def sampling_kwargs(temperature: float | None, top_k: int | None, top_p: float | None) -> dict[str, Any]:
    """Map TensorRT-LLM's request sampling fields onto the reference `generate` arguments."""
    top_k = int(top_k or 0)
    top_p = float(top_p) if top_p is not None and top_p > 0 else 0.0
    if top_k < 0:
        raise RequestError(f"runtime_top_k must be >= 0, got {top_k}")
    if top_p > 1.0:
        raise RequestError(f"runtime_top_p must be <= 1, got {top_p}")
    if top_k == 0 and top_p == 0.0:
        return {"temperature": 0.0, "top_k": 0, "top_p": 1.0}
    t = 1.0 if temperature is None else float(temperature)
    if t < 0:
        raise RequestError(f"temperature must be >= 0, got {t}")
    return {"temperature": t, "top_k": top_k, "top_p": top_p or 1.0}


def _stop_words(request: Any, batch: int, index: int) -> list[list[int]] | None:
    """Item `index` of the optional stop_words_list input ([batch, 2, N]); None when absent."""
    tensor = pb_utils.get_input_tensor_by_name(request, "stop_words_list")
    if tensor is None:
        return None
    values = tensor.as_numpy()
    if values.ndim != 3 or values.shape[0] != batch or values.shape[1] != 2:
        raise RequestError(f"stop_words_list has shape {list(values.shape)}; expected [{batch}, 2, N]")
    try:
        return from_word_list(values[index].tolist())
    except ValueError as exc:
        raise RequestError(f"stop_words_list: {exc}") from None


def _embedding_bias(request: Any, batch: int, index: int) -> Any:
    """Row `index` of the optional embedding_bias input (FP32 [batch, vocab]: added to the logits); None when absent
    or empty (TensorRT-LLM's backend skips an empty one). The runtime checks its length against the vocabulary."""
    tensor = pb_utils.get_input_tensor_by_name(request, "embedding_bias")
    if tensor is None:
        return None
    values = tensor.as_numpy()
    if values.size == 0:
        return None
    if values.ndim != 2 or values.shape[0] != batch:
        raise RequestError(f"embedding_bias has shape {list(values.shape)}; expected [{batch}, vocab]")
    return np.ascontiguousarray(values[index], np.float32)


class _Job:
    """One sequence of a request, parsed and validated."""

    def __init__(self, request: Any, batch: int, index: int, defaults: tuple, exclude_default: bool,
                 adapters: dict[int, str]) -> None:
        # defaults: (end_id, pad_id, stop words), used where the request carries none; adapters: task id → name
        ids = pb_utils.get_input_tensor_by_name(request, "input_ids")
        if ids is None:
            raise RequestError("input_ids is required")
        row = ids.as_numpy().reshape(batch, -1)[index]
        length = _scalar(request, "input_lengths", batch, index)
        length = row.size if length is None else int(length)
        if not 0 < length <= row.size:
            raise RequestError(f"input_lengths {length} outside 1..{row.size}")
        self.prompt = [int(t) for t in row[:length]]
        max_new = _scalar(request, "request_output_len", batch, index)
        if max_new is None or int(max_new) <= 0:
            raise RequestError(f"request_output_len must be > 0, got {max_new}")
        self.max_new_tokens = int(max_new)
        end_id, pad_id = (_scalar(request, name, batch, index) for name in ("end_id", "pad_id"))
        self.end_id = defaults[0] if end_id is None else int(end_id)
        self.pad_id = defaults[1] if pad_id is None else int(pad_id)
        words = _stop_words(request, batch, index)
        self.stop_words = defaults[2] if words is None else words
        self.streaming = bool(_scalar(request, "streaming", batch, index) or False)
        top = int(_scalar(request, "return_top_log_probs", batch, index) or 0)
        if not 0 <= top <= MAX_TOP_LOG_PROBS:
            raise RequestError(f"return_top_log_probs must be in 0..{MAX_TOP_LOG_PROBS}, got {top}")
        self.record = Record(want_log_probs=bool(_scalar(request, "return_log_probs", batch, index) or top),
                             want_context_logits=bool(_scalar(request, "return_context_logits", batch, index) or False),
                             top_log_probs=top)
        exclude = _scalar(request, "exclude_input_in_output", batch, index)
        self.exclude_input = exclude_default if exclude is None else bool(exclude)
        task = _scalar(request, "lora_task_id", batch, index)
        if task is not None and int(task) not in adapters:
            served = ", ".join(f"{n} ({t})" for t, n in sorted(adapters.items(), key=lambda kv: kv[1])) or "none"
            raise RequestError(f"lora_task_id {task}: no such adapter in this repository (served: {served})")
        self.adapter = None if task is None else adapters[int(task)]
        try:
            self.guide = parse_guide(_scalar(request, GUIDE_TYPE_INPUT, batch, index),
                                     _scalar(request, GUIDE_INPUT, batch, index))
        except GuideError as exc:
            raise RequestError(str(exc)) from None
        seed = _scalar(request, "seed", batch, index)
        penalty = _scalar(request, "repetition_penalty", batch, index)
        presence, frequency = (_scalar(request, name, batch, index) for name in ("presence_penalty", "frequency_penalty"))
        min_tokens = _scalar(request, "min_tokens", batch, index)
        self.kwargs = {
            **sampling_kwargs(
                _scalar(request, "temperature", batch, index),
                _scalar(request, "runtime_top_k", batch, index),
                _scalar(request, "runtime_top_p", batch, index),
            ),
            "repetition_penalty": 1.0 if penalty is None else float(penalty),
            "seed": 0 if seed is None else int(seed),
            "min_new_tokens": 0 if min_tokens is None else max(0, int(min_tokens)),
            "presence_penalty": 0.0 if presence is None else float(presence),
            "frequency_penalty": 0.0 if frequency is None else float(frequency),
            "embedding_bias": _embedding_bias(request, batch, index),
        }

    def submit(self, batcher: Batcher, grammars: Grammars) -> Stream:
        """Queue this sequence for generation; an invalid one (a guide that does not compile too) is refused here,
        before anything runs."""
        try:
            constraint = None if self.guide is None else grammars.constraint(
                *self.guide, stop_ids=[self.end_id, *(w[0] for w in self.stop_words if len(w) == 1)])
            return batcher.submit(self.prompt, self.max_new_tokens, self.end_id, stop_words=self.stop_words,
                                  record=self.record, adapter=self.adapter, constraint=constraint, **self.kwargs)
        except ValueError as exc:
            raise RequestError(str(exc)) from None


def _parse(request: Any, defaults: tuple, exclude_default: bool, adapters: dict[int, str]) -> list[_Job]:
    ids = pb_utils.get_input_tensor_by_name(request, "input_ids")
    if ids is None:
        raise RequestError("input_ids is required")
    batch = ids.as_numpy().shape[0]
    return [_Job(request, batch, i, defaults, exclude_default, adapters) for i in range(batch)]


def _context_logits_tensor(records: list[Record]) -> Any:
    """context_logits [batch, prompt tokens, vocab], zero-padded; rows not asked for stay zero."""
    shown = [r.context_logits for r in records if r.context_logits is not None]
    width = max(t.shape[0] for t in shown)
    out = np.zeros((len(records), width, shown[0].shape[1]), np.float32)
    for i, r in enumerate(records):
        if r.context_logits is not None:
            out[i, : r.context_logits.shape[0]] = r.context_logits.numpy()
    return pb_utils.Tensor("context_logits", out)


def _score_tensors(records: list[Record]) -> list[Any]:
    """The optional outputs any sequence of a non-streamed request asked for; none when none did."""
    tensors = []
    if any(r.want_log_probs for r in records):
        width = max(1, max(len(r.log_probs) for r in records))
        per_token = np.zeros((len(records), 1, width), np.float32)
        for i, r in enumerate(records):
            per_token[i, 0, : len(r.log_probs)] = r.log_probs
        cum = np.array([[r.cum_log_prob] for r in records], np.float32)
        tensors += [pb_utils.Tensor("cum_log_probs", cum), pb_utils.Tensor("output_log_probs", per_token)]
    if any(r.top_log_probs for r in records):
        tensors += _top_tensors(records)
    if any(r.context_logits is not None for r in records):
        tensors.append(_context_logits_tensor(records))
    return tensors


def _top_tensors(records: list[Record], first: int = 0, last: int | None = None) -> list[Any]:
    """top_log_prob_ids / top_log_probs [batch, tokens, k] for tokens first..last, zero-padded (k: the most asked)."""
    k = max(r.top_log_probs for r in records)
    rows = [r.top[first:last] for r in records]
    width = max(1, max(len(t) for t in rows))
    ids, values = np.zeros((len(records), width, k), np.int32), np.zeros((len(records), width, k), np.float32)
    for i, tokens in enumerate(rows):
        for j, pairs in enumerate(tokens):
            ids[i, j, : len(pairs)] = [t for t, _ in pairs]
            values[i, j, : len(pairs)] = [v for _, v in pairs]
    return [pb_utils.Tensor("top_log_prob_ids", ids), pb_utils.Tensor("top_log_probs", values)]


IN_FLIGHT_METRIC = "stoker_requests_in_flight"


class InFlight:
    """A gauge of requests begun and not yet answered; a no-op where Triton's metrics are off."""

    def __init__(self, model_name: str) -> None:
        try:
            # The family must outlive its metric (Triton deletes the metric with it), so both are kept.
            self.family = pb_utils.MetricFamily(name=IN_FLIGHT_METRIC, kind=pb_utils.MetricFamily.GAUGE,
                                                description="requests begun and not yet answered")
            self.gauge = self.family.Metric(labels={"model": model_name})
        except Exception:  # noqa: BLE001 -- metrics disabled (--allow-metrics=false): serving goes on without
            self.gauge = None
        self.lock = threading.Lock()

    def add(self, n: int) -> None:
        if self.gauge is not None:
            with self.lock:
                self.gauge.increment(n)


class TritonPythonModel:
    """Generates with the reference runtime; see the module docstring for the contract."""

    def initialize(self, args: dict[str, str]) -> None:
        config = json.loads(args["model_config"])
        version_dir = Path(args["model_repository"]) / args["model_version"]
        weights = Path(_param(config, "gpt_model_path", "weights"))
        if not weights.is_absolute():
            weights = version_dir / weights
        num_threads = int(_param(config, "num_threads", "2"))
        batch = int(_param(config, "max_concurrent_requests", str(config.get("max_batch_size") or DEFAULT_MAX_BATCH)))
        if batch < 1:
            raise ValueError(f"max_concurrent_requests must be >= 1, got {batch}")
        self.exclude_default = _param(config, "exclude_input_in_output", "false").lower() in ("1", "true", "yes")
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(config)
        # LoRA adapters the package step laid next to the weights (stoker/adapters.py): task id → name. An engine
        # repository (the stand-in serving target: tensorrt) has them converted in its lora_prefetch_dir instead,
        # one folder per task id, as TensorRT-LLM's backend preloads them.
        table_file = version_dir / "adapters" / "adapters.json"
        table = json.loads(table_file.read_text()) if table_file.is_file() else {}
        self.adapters = {int(entry["task_id"]): name for name, entry in table.items()}
        prefetch = _param(config, "lora_prefetch_dir", "")
        if prefetch:
            self.model = load_model(weights, num_threads=num_threads, trtllm_adapters={
                name: Path(prefetch) / str(entry["task_id"]) for name, entry in table.items()})
        else:
            self.model = load_model(weights, num_threads=num_threads,
                                    adapters={name: version_dir / "adapters" / name for name in table})
        stop_ids = json.loads((weights / RUNTIME_FILE).read_text()).get("stop_ids", [])
        self.defaults = (self.model.info.end_id, self.model.info.pad_id, [[int(i)] for i in stop_ids])
        self.stopping = threading.Event()
        self.batcher = Batcher(self.model, max_batch=batch).start()
        # Guides are compiled against the tokenizer (read on the first guided request, then kept).
        self.grammars = Grammars(Path(_param(config, "tokenizer_dir", str(weights))), self.model.vocab_size,
                                 tokenizer_info_path=_tokenizer_info_path(config))
        # Threads that wait on their sequences and send the tokens; requests beyond them wait for one.
        self.pool = ThreadPoolExecutor(max_workers=4 * batch + 4, thread_name_prefix="stoker-req")
        self.in_flight = InFlight(args.get("model_name", "tensorrt_llm"))
        pb_utils.Logger.log_info(
            f"tensorrt_llm (reference runtime): {weights}, {self.model.architecture} (transformers), quantization {self.model.info.quant_format}, "
            f"kv cache {self.model.info.kv_cache_dtype or 'float32'}, end_id {self.defaults[0]}, stop ids {stop_ids}, "
            f"decoupled {self.decoupled}, threads {num_threads}, in-flight batch {batch}"
        )

    def _check(self, request: Any) -> None:
        if self.stopping.is_set():
            raise Cancelled("model is shutting down")
        if request.is_cancelled():
            raise Cancelled("request cancelled")

    def _submit(self, jobs: list[_Job]) -> list[Stream]:
        """All of a request's sequences, queued together (decoded together); none when one is invalid."""
        streams: list[Stream] = []
        try:
            for job in jobs:
                streams.append(job.submit(self.batcher, self.grammars))
        except Exception:
            for stream in streams:
                stream.cancel()
            raise
        return streams

    def _tokens(self, request: Any, stream: Stream) -> Iterator[int]:
        check: Callable[[], None] = lambda: self._check(request)  # noqa: E731
        for token in stream.tokens(check=check):
            check()
            yield token

    def _full_output(self, request: Any, jobs: list[_Job]) -> list[Any]:
        rows: list[list[int]] = []
        streams = self._submit(jobs)
        try:
            for job, stream in zip(jobs, streams):
                generated = list(self._tokens(request, stream))
                rows.append(generated if job.exclude_input else job.prompt + generated)
        finally:
            for stream in streams:
                stream.cancel()
        width = max(1, max(len(r) for r in rows))
        output = np.empty((len(jobs), 1, width), np.int32)
        for i, (row, job) in enumerate(zip(rows, jobs)):
            output[i, 0, : len(row)] = row
            output[i, 0, len(row):] = job.pad_id
        lengths = np.array([[len(r)] for r in rows], np.int32)
        return [pb_utils.Tensor("output_ids", output), pb_utils.Tensor("sequence_length", lengths),
                *_score_tensors([job.record for job in jobs])]

    def _stream(self, request: Any, job: _Job, sender: Any) -> None:
        one = np.ones((1, 1), np.int32)
        record = job.record
        sent = 0
        for token in self._tokens(request, self._submit([job])[0]):
            tensors = [pb_utils.Tensor("output_ids", np.array([[[token]]], np.int32)), pb_utils.Tensor("sequence_length", one)]
            if record.want_log_probs:
                # By position, not [-1]: the batcher may already have chosen the next token (and appended its log
                # prob) by the time this thread sends this one (seen on a loaded host).
                mine = record.log_probs[: sent + 1]
                tensors += [pb_utils.Tensor("output_log_probs", np.array([[[mine[-1]]]], np.float32)),
                            pb_utils.Tensor("cum_log_probs", np.array([[float(sum(mine))]], np.float32))]
                if record.top_log_probs:
                    tensors += _top_tensors([record], sent, sent + 1)
            if sent == 0 and record.context_logits is not None:
                tensors.append(_context_logits_tensor([record]))
            sender.send(pb_utils.InferenceResponse(output_tensors=tensors))
            sent += 1
        if sent == 0 and record.context_logits is not None:
            # Nothing generated (end_id first): the prompt's logits still go back, with an empty output.
            tensors = [pb_utils.Tensor("output_ids", np.zeros((1, 1, 0), np.int32)),
                       pb_utils.Tensor("sequence_length", np.zeros((1, 1), np.int32)), _context_logits_tensor([record])]
            sender.send(pb_utils.InferenceResponse(output_tensors=tensors))
        sender.send(flags=FINAL)

    def _serve(self, request: Any) -> None:
        """Answer one decoupled request; always ends with a FINAL-flagged send."""
        sender = request.get_response_sender()
        try:
            jobs = _parse(request, self.defaults, self.exclude_default, self.adapters)
            if any(job.streaming for job in jobs):
                if len(jobs) != 1:
                    raise RequestError("streaming takes one sequence per request; send a batch as separate requests")
                self._stream(request, jobs[0], sender)
            else:
                sender.send(pb_utils.InferenceResponse(output_tensors=self._full_output(request, jobs)), flags=FINAL)
        except Exception as exc:  # noqa: BLE001 -- every failure goes back as a response, never crashes the model
            sender.send(pb_utils.InferenceResponse(error=self._error(exc)), flags=FINAL)
        finally:
            self.in_flight.add(-1)

    @staticmethod
    def _error(exc: Exception) -> Any:
        if isinstance(exc, Cancelled):
            return pb_utils.TritonError(str(exc), pb_utils.TritonError.CANCELLED)
        if isinstance(exc, RequestError):
            return pb_utils.TritonError(str(exc), pb_utils.TritonError.INVALID_ARG)
        pb_utils.Logger.log_error(f"tensorrt_llm: {type(exc).__name__}: {exc}")
        return pb_utils.TritonError(f"internal error: {type(exc).__name__}: {exc}")

    def _answer(self, request: Any) -> Any:
        """Answer one request of a non-decoupled model (no streaming possible)."""
        try:
            jobs = _parse(request, self.defaults, self.exclude_default, self.adapters)
            if any(job.streaming for job in jobs):
                raise RequestError("streaming needs the model to be decoupled (model_transaction_policy)")
            return pb_utils.InferenceResponse(output_tensors=self._full_output(request, jobs))
        except Exception as exc:  # noqa: BLE001 -- every failure goes back as a response, never crashes the model
            return pb_utils.InferenceResponse(error=self._error(exc))

    def execute(self, requests: list[Any]) -> list[Any] | None:
        self.in_flight.add(len(requests))
        if not self.decoupled:
            try:
                return [self._answer(r) for r in requests]
            finally:
                self.in_flight.add(-len(requests))
        for request in requests:
            self.pool.submit(self._serve, request)
        return None

    def finalize(self) -> None:
        # In-flight and waiting generations see `stopping` within a token (or 50 ms) and answer CANCELLED.
        self.stopping.set()
        self.pool.shutdown(wait=True)
        self.batcher.stop()
