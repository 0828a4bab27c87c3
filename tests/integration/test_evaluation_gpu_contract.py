"""GPU targets' accuracy baseline, by contract (no TensorRT-LLM here): a quantized build needs the bf16 build's
record in a real S3 (moto), per target; a missing one is recorded first (the target's record_baseline, run end to end
on the stand-in in test_standin_pytorch.py), or refused in one line before any GPU step when the spec asks to require
it; perplexity only where the engine serves context logits."""

from __future__ import annotations

import boto3
import pytest

from stoker.errors import StepError
from stoker.evaluation import metrics
from stoker.spec.load import parse_spec
from tasks.evaluate import record_key, require_record

pytestmark = [pytest.mark.s3]


def _spec(s3_url: str, bucket: str, fmt: str, require: bool = False, **build):
    return parse_spec({"model": {"repo_id": "org/llama"}, "target": "tensorrt", "gpus": {"type": "h100-80gb"},
                       "quantization": {"format": fmt}, "build": build,
                       "evaluation": {"require_recorded_baseline": require},
                       "storage": {"bucket": bucket, "endpoint_url": s3_url}})


@pytest.fixture
def bucket(local_stack, monkeypatch):
    for k, v in local_stack["aws_env"].items():
        monkeypatch.setenv(k, v)
    env = local_stack["aws_env"]
    client = boto3.client("s3", endpoint_url=local_stack["s3"], region_name="us-east-1",
                          aws_access_key_id=env["AWS_ACCESS_KEY_ID"], aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"])
    name = "gpu-eval-contract"
    client.create_bucket(Bucket=name)
    return client, name, local_stack["s3"]


def test_quantized_gpu_build_needs_the_recorded_bf16_baseline(bucket):
    client, name, url = bucket
    fp8 = _spec(url, name, "fp8")
    assert require_record(fp8, "weights123", "evalset456") == "missing"  # the run records it first
    with pytest.raises(StepError) as err:
        require_record(_spec(url, name, "fp8", require=True), "weights123", "evalset456")
    msg = str(err.value)
    assert "\n" not in msg and "no bf16 baseline recorded" in msg and "quantization.format none" in msg
    assert f"s3://{name}/stoker/evaluation/baselines/tensorrt/weights123/evalset456.json" in msg
    assert require_record(_spec(url, name, "none"), "weights123", "evalset456") is None  # a bf16 run is its own
    client.put_object(Bucket=name, Key=record_key(fp8, "weights123", "evalset456"), Body=b'{"perplexity": 9.5}')
    assert require_record(_spec(url, name, "fp8", require=True), "weights123", "evalset456") == "present"


def test_gpu_targets_evaluate_against_the_record_and_perplexity_needs_context_logits(bucket):
    from stoker import targets

    _client, name, url = bucket
    trt = targets.get("tensorrt")
    assert trt.evaluates and trt.baseline_source == "recorded" and trt.tolerance(_spec(url, name, "fp8")) == 0.1
    assert not trt.scores_perplexity(_spec(url, name, "fp8"))
    assert trt.scores_perplexity(_spec(url, name, "fp8", gather_context_logits=True))
    assert not targets.get("pytorch").scores_perplexity(_spec(url, name, "fp8"))  # text in, text out
    rows, cause = metrics.verdict({"perplexity": None, "agreement": {"token_match_rate": 0.9,
                                                                    "mean_first_divergence": 10.0,
                                                                    "exact_matches": 5, "prompts": 8}},
                                  {"perplexity": 12.0}, {"max_perplexity_rise_pct": 10, "min_greedy_agreement": 0.5})
    assert cause is None and rows[0].delta == "n/a" and rows[0].passed is None
