"""Every serve command restricts Triton's admin APIs; deploy.openai on GPU targets is stoker's OpenAI service, not
Triton's frontend (whose KServe endpoints cannot restrict them); what the frontend's facts still pin down.

Contract tests: rendered by contract, not run here (no GPU, no TensorRT-LLM, no NGC image). The upstream facts they
check against are recorded in stoker/gpu/openai_frontend.py with their commits.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models

from stoker.triton import config as triton_config
from stoker.gpu import inflight, openai_frontend, repository, rules, trtllm
from stoker.gpu.facts import known
from stoker.containers.ports import Ports
from stoker.spec.load import load_spec, parse_spec

SPECS = Path(__file__).resolve().parents[2] / "deployments" / "specs"
CURRENT = "nvcr.io/nvidia/tritonserver:26.07-trtllm-python-py3"
LLAMA = known("meta-llama/Meta-Llama-3-8B-Instruct")
# main.py's options in v2.68.0 (26.04, the oldest image stoker supports; commit
# dd16c0cad0399599240e8eb37178865eca994303). Every flag stoker renders must be one of them.
FLAGS_26_04 = {"--model-repository", "--tokenizer", "--backend", "--lora-separator",
               "--tritonserver-log-verbose-level", "--host", "--tool-call-parser", "--chat-template",
               "--default-max-tokens", "--model-control-mode", "--load-model", "--openai-port", "--uvicorn-log-level",
               "--openai-restricted-api", "--enable-kserve-frontends", "--kserve-http-port", "--kserve-grpc-port"}


def gpu_spec(**over):
    data = {"model": {"repo_id": "meta-llama/Meta-Llama-3-8B-Instruct"}, "storage": {"bucket": "bkt"},
            "target": "tensorrt", "gpus": {"type": "h100-80gb", "count": 2}, "deploy": {"image": CURRENT}}
    for k, v in over.items():
        data[k] = {**data.get(k, {}), **v} if isinstance(v, dict) and isinstance(data.get(k), dict) else v
    return parse_spec(data)


def openai_findings(spec) -> list[tuple[str, str]]:
    return [(f.level, f.message) for f in rules.check(spec, LLAMA, True) if f.field == "deploy.openai"]


@pytest.mark.parametrize("path", sorted(SPECS.glob("*.yaml")), ids=lambda p: p.stem)
def test_every_example_specs_serve_command_restricts_the_admin_apis(path):
    """The command each backend of every example spec runs: every tritonserver process in it (one, or one per MPI
    rank) restricts model repository, shared memory, statistics, trace and logging to the token, which its argv
    carries only as the shim's placeholder (the token itself is in the environment: stoker/containers/argv_secret.py)."""
    from stoker.containers import argv_secret, engine
    from stoker.deploy.rollout import backend_spec

    spec = load_spec(path)
    gpus = tuple(range(spec.parallel.world_size)) if spec.target != "reference" else ()
    b = backend_spec(spec, "/host/repo" if spec.target != "reference" else "s3://bkt/repo", "d" * 64, {}, gpus=gpus)
    argv = engine.backend_command(b, Ports(21000, 21001, 21002))
    tok3n = argv_secret.PLACEHOLDER
    servers = argv.count("tritonserver") + sum(a.endswith("/tritonserver") for a in argv) or 1
    assert sum(a.startswith("--http-restricted-api=") and a.endswith(f"={tok3n}") for a in argv) == servers, argv
    assert sum(a.startswith("--grpc-restricted-protocol=") and a.endswith(f"={tok3n}") for a in argv) == servers, argv
    assert "openai_frontend/main.py" not in " ".join(argv)
    assert all(a.split("=", 1)[1] == "127.0.0.1" for a in argv if a.endswith("-address=127.0.0.1") or
               a.startswith(("--http-address=", "--grpc-address=", "--metrics-address=")))


@pytest.mark.parametrize("path", sorted(SPECS.glob("*.yaml")), ids=lambda p: p.stem)
def test_a_backend_is_given_credentials_only_when_it_reads_s3(path, tmp_path, monkeypatch):
    """A GPU backend's repository is mounted from the host: it gets neither the credentials file nor its path. The
    reference target's backend loads from S3 and gets both (the file, never the keys)."""
    from stoker.deploy.rollout import backend_spec
    from stoker.storage import credentials

    monkeypatch.setenv("STOKER_HOME", str(tmp_path))
    spec = load_spec(path)
    env = {"AWS_SHARED_CREDENTIALS_FILE": f"{credentials.INSIDE}/credentials", "AWS_DEFAULT_REGION": "us-east-1"}
    gpus = tuple(range(spec.parallel.world_size)) if spec.target != "reference" else ()
    b = backend_spec(spec, "/host/repo" if spec.target != "reference" else "s3://bkt/repo", "d" * 64, env, gpus=gpus)
    folder = str(credentials.folder_of(spec.deploy.name))
    if spec.target == "reference":
        assert b.env == env and b.mounts.get(folder) == credentials.INSIDE
    else:
        assert b.env == {} and folder not in b.mounts and not b.repository_uri.startswith("s3://")


def test_gpu_targets_serve_openai_through_stokers_service():
    from stoker.deploy.rollout import target_for
    from stoker.stack.image import DEFAULT_IMAGE

    for name in ("llama3-8b-fp8-h100-engine.yaml", "llama3-8b-fp8-llmapi-h100.yaml"):
        spec = load_spec(SPECS / name)
        assert spec.deploy.openai and not openai_frontend.renders(spec)
        assert trtllm.serve_command(spec, Ports(21000, 21001, 21002), ["--x"])[0] == "tritonserver"
        target = target_for(spec)
        assert target.openai_image == DEFAULT_IMAGE and not target.openai_on_metrics


def test_rendered_flags_exist_in_every_supported_image():
    argv = openai_frontend.argv(8000, 8001)
    assert {a for a in argv if a.startswith("--")} <= FLAGS_26_04


def test_names_match_what_the_package_step_writes():
    # openai_frontend repeats these to stay import-light; they must not drift.
    assert openai_frontend.MODEL_NAME == triton_config.ENSEMBLE_NAME == "ensemble"
    assert openai_frontend.C_MODELS == trtllm.C_MODELS
    tokenizer_dir = triton_config.RepoSettings().tokenizer_dir
    assert openai_frontend.TOKENIZER_DIR == f"{trtllm.C_MODELS}/preprocessing/1/{tokenizer_dir}"


def test_the_plan_says_what_serves():
    [(level, message)] = openai_findings(gpu_spec(gpus={"count": 1}))
    assert level == "note" and message.startswith("stoker's OpenAI service") and "cannot restrict" in message


def test_openai_off_keeps_tritonserver():
    spec = gpu_spec(gpus={"count": 1}, deploy={"openai": False})
    assert not openai_frontend.renders(spec) and openai_findings(spec) == []
    assert trtllm.serve_command(spec, Ports(21000, 21001, 21002), ["--x"]) == [
        "tritonserver", "--model-repository=/models", "--http-address=127.0.0.1", "--http-port=21000",
        "--grpc-address=127.0.0.1", "--grpc-port=21001", "--metrics-address=127.0.0.1", "--metrics-port=21002", "--x"]


def test_several_ranks_run_one_mpi_rank_per_gpu_on_loopback_with_the_restricted_apis():
    spec = gpu_spec(parallel={"tensor": 2})
    assert not openai_frontend.renders(spec)
    argv = trtllm.serve_command(spec, Ports(21000, 21001, 21002), ["--restricted"])
    assert argv[:2] == ["mpirun", "--allow-run-as-root"]
    ranks = " ".join(argv[2:]).split(" : ")
    assert len(ranks) == 2
    for i, rank in enumerate(ranks):
        assert rank.startswith("-n 1 tritonserver --model-repository=/models")
        assert "--http-address=127.0.0.1 --http-port=21000" in rank and "--restricted" in rank
        assert f"shm-region-prefix-name=prefix{i}_" in rank
        # Rank 0 serves every model; the others load only the engine (they stay in the backend's worker loop).
        assert ("--load-model=tensorrt_llm" in rank) is (i > 0)


@pytest.mark.parametrize("tag, ships", [("24.09", False), ("24.11", False), ("24.12", True), ("26.04", True),
                                        ("26.07", True)])
def test_first_release_that_ships_it(tag, ships):
    assert openai_frontend.ships_frontend(f"nvcr.io/nvidia/tritonserver:{tag}-trtllm-python-py3") is ships
    assert not openai_frontend.ships_frontend("stoker/triton-cpu:2.51.0-cpu")


def test_a_refused_image_is_refused_once():
    spec = gpu_spec(gpus={"count": 1}, deploy={"image": "nvcr.io/nvidia/tritonserver:24.09-trtllm-python-py3"})
    assert [f.field for f in rules.check(spec, LLAMA, True) if f.level == "refuse"] == ["deploy.image"]


def test_ensemble_takes_what_the_frontend_sends():
    """Every TRT-LLM request from the frontend names return_num_input/output_tokens; the usage comes back
    as num_input/output_tokens. Inputs declared once each."""
    cfg = inflight.ensemble(gpu_spec(gpus={"count": 1}))
    names = [t.name for t in cfg.input]
    assert len(names) == len(set(names))
    sent = {"text_input", "max_tokens", "stream", "stop_words", "top_p", "temperature", "seed",
            "frequency_penalty", "presence_penalty", "exclude_input_in_output", "return_num_input_tokens",
            "return_num_output_tokens"}
    assert sent <= set(names)
    gen = next(s for s in cfg.ensemble_scheduling.step if s.model_name == "tensorrt_llm")
    assert gen.input_map["return_num_input_tokens"] == "return_num_input_tokens"
    assert gen.output_map["num_output_tokens"] == "num_output_tokens"
    assert {"num_input_tokens", "num_output_tokens"} <= {o.name for o in cfg.output}


def test_package_copies_the_chat_template(tmp_path):
    src = tmp_path / "hf"
    src.mkdir()
    for name in ("tokenizer_config.json", "chat_template.jinja"):
        (src / name).write_text("{}" if name.endswith(".json") else "{{ messages }}")
    # A real tokenizer.json: the package step also writes the engine's xgrammar tokenizer info from it.
    Tokenizer(models.WordLevel({"<|eot_id|>": 0}, unk_token="<|eot_id|>")).save(str(src / "tokenizer.json"))
    facts = dataclasses.replace(LLAMA, end_id=0, pad_id=0, stop_ids=())
    repository.write_repository(gpu_spec(gpus={"count": 1}), facts, tmp_path / "repo", tokenizer_src=src)
    assert (tmp_path / "repo" / "preprocessing/1/tokenizer/chat_template.jinja").read_text() == "{{ messages }}"
