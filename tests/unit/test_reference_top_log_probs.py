"""The reference `tensorrt_llm` model's top log probs (return_top_log_probs → top_log_prob_ids / top_log_probs), its
model.py run as Triton installs it, with a stand-in for Triton's python-backend module, against transformers."""

from __future__ import annotations

import importlib.util
import sys
import threading
import types

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_runtime import NO_END, PROMPT, hf_model, write_artifact

from stoker.triton.models import install_model_code

TOL = 1e-4


class _Tensor:
    def __init__(self, name: str, value) -> None:
        self.name, self.value = name, np.asarray(value)

    def as_numpy(self):
        return self.value


class _Response:
    def __init__(self, output_tensors=(), error=None) -> None:
        self.tensors, self.error = {t.name: t.value for t in output_tensors}, error


class _Error(Exception):
    INVALID_ARG, CANCELLED = "INVALID_ARG", "CANCELLED"

    def __init__(self, message: str, code=None) -> None:
        super().__init__(message)


def _pb_utils() -> types.ModuleType:
    """What model.py uses of Triton's triton_python_backend_utils, for a test without Triton."""
    pb = types.ModuleType("triton_python_backend_utils")
    pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
    pb.Tensor, pb.InferenceResponse, pb.TritonError = _Tensor, _Response, _Error
    pb.get_input_tensor_by_name = lambda request, name: request.inputs.get(name)
    pb.Logger = types.SimpleNamespace(log_info=print, log_error=print)
    return pb


class _Request:
    def __init__(self, **inputs) -> None:
        self.inputs = {k: _Tensor(k, v) for k, v in inputs.items()}

    def is_cancelled(self) -> bool:
        return False


class _Sender:
    def __init__(self) -> None:
        self.responses: list[_Response] = []

    def send(self, response=None, flags=0) -> None:
        if response is not None:
            self.responses.append(response)


# What importing the installed model.py adds to sys.modules (only these go again: transformers' lazy imports stay).
_INSTALLED = {"triton_python_backend_utils", "reference_trtllm_model", "stoker_runtime", "stoker_stop_words"}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """model.py imported from an installed repository, its in-flight batcher over a tiny Llama; transformers' too."""
    repo = tmp_path_factory.mktemp("repo")
    install_model_code(repo)
    version = repo / "tensorrt_llm" / "1"
    before = set(sys.modules)
    sys.modules["triton_python_backend_utils"] = _pb_utils()
    try:
        spec = importlib.util.spec_from_file_location("reference_trtllm_model", version / "model.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        ref = hf_model()
        model = sys.modules["stoker_runtime.model"].load_model(write_artifact(ref, tmp_path_factory.mktemp("a")),
                                                               num_threads=2)
        triton = module.TritonPythonModel.__new__(module.TritonPythonModel)
        triton.stopping = threading.Event()
        triton.batcher = sys.modules["stoker_runtime.batch"].Batcher(model, max_batch=2).start()
        # No guided request here: the tokenizer folder is read only on the first one.
        triton.grammars = module.Grammars(tmp_path_factory.mktemp("no-tokenizer"), model.vocab_size)
        yield module, triton, ref
        triton.batcher.stop()
    finally:
        # model.py put its folder on sys.path and imported the runtime under its Triton name: take both back.
        for name in set(sys.modules) - before:
            if name.split(".")[0] in _INSTALLED:
                del sys.modules[name]
        if str(version) in sys.path:
            sys.path.remove(str(version))


def _request(k: int, n: int, streaming: bool) -> _Request:
    return _Request(input_ids=np.array([PROMPT], np.int32), input_lengths=np.array([[len(PROMPT)]], np.int32),
                    request_output_len=np.array([[n]], np.int32), streaming=np.array([[streaming]]),
                    end_id=np.array([[NO_END]], np.int32), return_top_log_probs=np.array([[k]], np.int32))


def _transformers_top(ref, tokens: list[int], k: int):
    with torch.no_grad():
        logits = ref(input_ids=torch.tensor([PROMPT + tokens])).logits[0].float()
    return torch.topk(torch.log_softmax(logits[len(PROMPT) - 1: -1], -1), k)


def test_streamed_top_log_probs_are_transformers_top_k(served):
    module, triton, ref = served
    k, n = 4, 6
    request = _request(k, n, streaming=True)
    job = module._parse(request, (NO_END, 0, []), True, {})[0]
    sender = _Sender()
    triton._stream(request, job, sender)
    tokens = [int(r.tensors["output_ids"].reshape(-1)[0]) for r in sender.responses]
    assert len(tokens) == n
    want = _transformers_top(ref, tokens, k)
    for i, r in enumerate(sender.responses):
        assert r.tensors["top_log_prob_ids"].shape == (1, 1, k) and r.tensors["top_log_probs"].shape == (1, 1, k)
        assert r.tensors["top_log_prob_ids"].reshape(-1).tolist() == want.indices[i].tolist()
        assert np.allclose(r.tensors["top_log_probs"].reshape(-1), want.values[i].numpy(), atol=TOL)
        # return_top_log_probs implies the sampled token's own log prob; greedy: the first alternative's
        assert r.tensors["output_log_probs"].reshape(-1)[0] == pytest.approx(want.values[i][0].item(), abs=TOL)


def test_a_non_streamed_batch_pads_the_alternatives(served):
    module, triton, ref = served
    request = _request(3, 5, streaming=False)
    out = {t.name: t.value for t in triton._full_output(request, module._parse(request, (NO_END, 0, []), True, {}))}
    tokens = out["output_ids"].reshape(-1).tolist()
    assert out["top_log_prob_ids"].shape == (1, 5, 3)
    want = _transformers_top(ref, tokens, 3)
    assert out["top_log_prob_ids"][0].tolist() == want.indices.tolist()
    assert np.allclose(out["top_log_probs"][0], want.values.numpy(), atol=TOL)


def test_return_top_log_probs_out_of_range_is_refused_before_generating(served):
    module, _, _ = served
    for k in (-1, 21):
        with pytest.raises(module.RequestError, match="return_top_log_probs"):
            module._parse(_request(k, 2, streaming=True), (NO_END, 0, []), True, {})
    plain = _Request(input_ids=np.array([PROMPT], np.int32), input_lengths=np.array([[len(PROMPT)]], np.int32),
                     request_output_len=np.array([[2]], np.int32))
    record = module._parse(plain, (NO_END, 0, []), True, {})[0].record
    assert record.top_log_probs == 0 and not record.want_log_probs  # not asked: as before


def test_the_engine_repositorys_guided_decoding_parameters_pick_the_tokenizer_info_file(served, tmp_path):
    """The engine stand-in serves this model.py over the engine repository: it reads upstream's two parameters as
    TensorRT-LLM's C++ backend does (both set, or tokenizer_dir as before; only xgrammar; the file must exist)."""
    module, _, _ = served
    info = tmp_path / "xgrammar_tokenizer_info.json"
    info.write_text("{}")

    def config(**params):
        return {"parameters": {k: {"string_value": v} for k, v in params.items()}}

    assert module._tokenizer_info_path(config()) is None
    assert module._tokenizer_info_path(config(xgrammar_tokenizer_info_path=str(info))) is None
    assert module._tokenizer_info_path(config(guided_decoding_backend="xgrammar",
                                              xgrammar_tokenizer_info_path=str(info))) == info
    with pytest.raises(ValueError, match="only 'xgrammar'"):
        module._tokenizer_info_path(config(guided_decoding_backend="llguidance", xgrammar_tokenizer_info_path=str(info)))
    with pytest.raises(ValueError, match="does not exist"):
        module._tokenizer_info_path(config(guided_decoding_backend="xgrammar",
                                           xgrammar_tokenizer_info_path=str(tmp_path / "absent.json")))
