"""ServerDistillationTrainer against a real vLLM teacher (`posttrain vllm-serve` with the untied tiny Llama): the
server's `prompt_logprobs` answer is parsed as vLLM writes it, and the loss equals the float64 reference computed
from the same teacher loaded locally (vLLM's float32 CPU log-probs: rel 1e-4)."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import ServerProcess
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

pytestmark = pytest.mark.vllm

WORDS = "red green blue cat dog bird fish sky sun moon tree one two three".split()


@pytest.fixture(scope="module")
def teacher_server(vllm_tiny_untied_path, tmp_path_factory):
    pytest.importorskip("vllm")
    server = ServerProcess(vllm_tiny_untied_path, tmp_path_factory.mktemp("vllm-teacher"))
    yield server.ensure()
    server.stop()


@pytest.mark.parametrize("beta,k", [(0.0, 3), (0.5, 1)])
def test_loss_against_a_vllm_teacher(tmp_path, vllm_tiny_path, vllm_tiny_untied_path, teacher_server, beta, k):
    from test_server_distillation import _reference

    from posttrain.experimental.server_distillation import ServerDistillationConfig, ServerDistillationTrainer

    rng = random.Random(0)
    data = Dataset.from_list(
        [
            {"prompt": " ".join(rng.choices(WORDS, k=3)), "completion": " " + " ".join(rng.choices(WORDS, k=1 + i % 3))}
            for i in range(4)
        ]
    )
    tokenizer = AutoTokenizer.from_pretrained(vllm_tiny_path)
    trainer = ServerDistillationTrainer(
        AutoModelForCausalLM.from_pretrained(vllm_tiny_path),
        train_dataset=data,
        processing_class=tokenizer,
        args=ServerDistillationConfig(
            output_dir=str(tmp_path),
            per_device_train_batch_size=4,
            lmbda=0.0,
            beta=beta,
            loss_top_k=k,
            teacher_model_server_url=teacher_server,
            use_cpu=True,
            bf16=False,
            report_to="none",
            save_strategy="no",
            max_steps=1,
        ),
    )
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    trainer.model.eval()
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, batch).item()
    teacher = AutoModelForCausalLM.from_pretrained(vllm_tiny_untied_path).eval()
    tokens = int((batch["labels"][:, 1:] != -100).sum())
    expected = _reference(trainer.model, teacher, batch, beta, k, True, 1.0) / tokens
    assert expected > 1e-4
    assert loss == pytest.approx(expected, rel=1e-4)
