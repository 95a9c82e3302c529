"""ServerDistillationTrainer (posttrain.experimental.server_distillation) against a teacher served over HTTP: a
stand-in for a vLLM server (the OpenAI `/v1/completions` route with `prompt_logprobs`, answered from a local tiny
teacher) runs in a thread. The loss is checked against a float64 reference written from TRL's sparse rule, the
trainer learns, and every unusable setting stops before training."""

import json
import math
import random
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from _trl import import_trl_experimental
from datasets import Dataset

from posttrain.errors import ConfigError
from posttrain.experimental.server_distillation import ServerDistillationConfig, ServerDistillationTrainer
from posttrain.generation import teacher_server
from posttrain.models.tiny import build_tiny_model

WORDS = "red green blue cat dog bird fish sky sun moon tree one two three".split()


def _teacher(tokenizer):
    teacher = build_tiny_model(tokenizer, seed=1, hidden_size=64, tie=False)
    with torch.no_grad():
        teacher.lm_head.weight.mul_(5.0)
    return teacher.eval()


class _TeacherHandler(BaseHTTPRequestHandler):
    """vLLM's answer shape: per prompt position (None at 0) the top-k tokens and the actual one, with ranks."""

    model = None
    requests: list = []

    def log_message(self, *args):
        pass

    def _send(self, payload):
        data = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._send({"data": [{"id": "tiny-teacher"}]})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append(body)
        k, choices = body["prompt_logprobs"], []
        for index, sequence in enumerate(body["prompt"]):
            with torch.no_grad():
                logits = self.model(torch.tensor([sequence])).logits[0].double()
            logps = (logits / body["temperature"]).log_softmax(-1)
            positions = [None]
            for j in range(1, len(sequence)):
                row = logps[j - 1]
                order = row.argsort(descending=True).tolist()
                shown = order[:k] + ([sequence[j]] if sequence[j] not in order[:k] else [])
                positions.append({str(t): {"logprob": row[t].item(), "rank": order.index(t) + 1} for t in shown})
            choices.append({"index": index, "prompt_logprobs": positions, "text": ""})
        self._send({"choices": choices})


@pytest.fixture(scope="module")
def teacher_url(tokenizer):
    _TeacherHandler.model = _teacher(tokenizer)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _TeacherHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def _data(n, seed=0):
    rng = random.Random(seed)
    return Dataset.from_list(
        [
            {"prompt": " ".join(rng.choices(WORDS, k=3)), "completion": " " + " ".join(rng.choices(WORDS, k=1 + i % 3))}
            for i in range(n)
        ]
    )


def _args(tmp_path, url, **kw):
    base = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        max_steps=2,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,
        seed=0,
        max_length=64,
        disable_tqdm=True,
        lmbda=0.0,
        teacher_model_server_url=url,
    )
    base.update(kw)
    return ServerDistillationConfig(**base)


def _reference(student, teacher, batch, beta, k, add_tail, temperature):
    """Float64, position by position, from TRL's rule: the support is the teacher's top-k (beta=0), the sequence's
    token (beta=1) or both the teacher's top-1 and it (once if equal); tail = 1 - the support's mass."""
    total = 0.0
    with torch.no_grad():
        s_all = (
            student(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.double() / temperature
        ).log_softmax(-1)
    for row in range(len(batch["input_ids"])):
        n = int(batch["attention_mask"][row].sum())
        ids = batch["input_ids"][row, :n]
        with torch.no_grad():
            t_all = (teacher(ids[None]).logits[0].double() / temperature).log_softmax(-1)
        for j in range(1, n):
            if batch["labels"][row, j] == -100:
                continue
            s_lp, t_lp, token = s_all[row, j - 1], t_all[j - 1], int(ids[j])
            top = t_lp.argsort(descending=True).tolist()
            support = top[:k] if beta == 0 else [token] if beta == 1 else list(dict.fromkeys([top[0], token]))
            p = [math.exp(s_lp[i]) for i in support]
            q = [math.exp(t_lp[i]) for i in support]
            if add_tail:
                p, q = p + [1 - sum(p)], q + [1 - sum(q)]
            else:
                p, q = [x / sum(p) for x in p], [x / sum(q) for x in q]
            if beta == 0:
                total += sum(b * math.log(b / a) for a, b in zip(p, q))
            elif beta == 1:
                total += sum(a * math.log(a / b) for a, b in zip(p, q))
            else:
                m = [(1 - beta) * a + beta * b for a, b in zip(p, q)]
                total += sum(beta * b * math.log(b / c) + (1 - beta) * a * math.log(a / c) for a, b, c in zip(p, q, m))
    return total


@pytest.mark.parametrize(
    "beta,k,add_tail,temperature",
    [(0.0, 3, True, 1.0), (0.0, 2, False, 0.7), (1.0, 1, True, 1.0), (0.5, 1, True, 1.3), (0.5, 1, False, 1.0)],
)
def test_loss_matches_a_float64_reference(tmp_path, tokenizer, teacher_url, beta, k, add_tail, temperature):
    trainer = ServerDistillationTrainer(
        build_tiny_model(tokenizer),
        args=_args(tmp_path, teacher_url, beta=beta, loss_top_k=k, loss_add_tail=add_tail, temperature=temperature),
        train_dataset=_data(4),
        processing_class=tokenizer,
    )
    assert trainer.teacher_model is None
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    _TeacherHandler.requests.clear()
    trainer.model.eval()
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, batch).item()
    assert len(_TeacherHandler.requests) == 1 and _TeacherHandler.requests[0]["prompt_logprobs"] == k
    assert _TeacherHandler.requests[0]["temperature"] == temperature
    tokens = int((batch["labels"][:, 1:] != -100).sum())
    expected = _reference(trainer.model, _TeacherHandler.model, batch, beta, k, add_tail, temperature) / tokens
    assert expected > 1e-4  # a reverse KL on the one sampled token is small for a near-uniform student
    assert loss == pytest.approx(expected, rel=1e-5)


def test_student_learns_from_the_served_teacher(tmp_path, tokenizer, teacher_url):
    trainer = ServerDistillationTrainer(
        build_tiny_model(tokenizer),
        args=_args(tmp_path, teacher_url, beta=0.0, loss_top_k=4, max_steps=25, logging_steps=5),
        train_dataset=_data(32),
        processing_class=tokenizer,
    )
    trainer.train()
    losses = [h["distill_loss"] for h in trainer.state.log_history if "distill_loss" in h]
    agreement = [h["teacher_agreement"] for h in trainer.state.log_history if "teacher_agreement" in h]
    assert len(losses) == 5
    assert losses[-1] < 0.6 * losses[0], losses
    assert agreement[-1] > agreement[0], agreement


def test_on_policy_completions_are_scored_by_the_server(tmp_path, tokenizer, teacher_url):
    trainer = ServerDistillationTrainer(
        build_tiny_model(tokenizer),
        args=_args(tmp_path, teacher_url, lmbda=1.0, max_completion_length=4, max_steps=1),
        train_dataset=_data(4).remove_columns("completion"),
        processing_class=tokenizer,
    )
    _TeacherHandler.requests.clear()
    trainer.train()
    assert len(_TeacherHandler.requests) == 1 and len(_TeacherHandler.requests[0]["prompt"]) == 4
    assert trainer.state.log_history[0]["on_policy"] == 1.0 and trainer.state.log_history[0]["distill_loss"] > 0


@pytest.mark.parametrize(
    "settings,match",
    [
        (dict(teacher_model_server_url=None), "teacher_model_server_url"),
        (dict(loss_top_k=0), "loss_top_k"),
        (dict(beta=0.5, loss_top_k=2), "loss_top_k"),
        (dict(reverse_kl_top_1_mode="argmax"), "argmax"),
        (dict(lmbda=0.0, padding_free=True), "padding_free"),
    ],
)
def test_unusable_settings_stop_at_the_config(tmp_path, settings, match):
    with pytest.raises(ConfigError, match=match):
        _args(tmp_path, "http://127.0.0.1:1", **settings)


def test_an_unreachable_server_stops_before_training(tmp_path, tokenizer, monkeypatch):
    monkeypatch.setattr(teacher_server, "CONNECT_TIMEOUT_S", 0.5)
    with pytest.raises(ConfigError, match=r"http://127.0.0.1:9.*vllm serve"):
        ServerDistillationTrainer(
            build_tiny_model(tokenizer),
            args=_args(tmp_path, "http://127.0.0.1:9"),
            train_dataset=_data(4),
            processing_class=tokenizer,
        )


def test_a_local_teacher_is_refused(tmp_path, tokenizer, teacher_url):
    with pytest.raises(ConfigError, match="teacher_model"):
        ServerDistillationTrainer(
            build_tiny_model(tokenizer),
            args=_args(tmp_path, teacher_url, teacher_model_name_or_path="x"),
            train_dataset=_data(4),
            processing_class=tokenizer,
        )


def test_config_fields_and_signature_are_trls():
    import dataclasses
    import inspect

    theirs = import_trl_experimental("server_distillation")
    ours = {f.name: f.default for f in dataclasses.fields(ServerDistillationConfig)}
    for name in (
        "teacher_model_server_url",
        "vllm_server_port",
        "loss_top_k",
        "loss_add_tail",
        "reverse_kl_top_1_mode",
    ):
        assert ours[name] == theirs.ServerDistillationConfig.__dataclass_fields__[name].default, name
    params = list(inspect.signature(ServerDistillationTrainer.__init__).parameters)[1:]
    trl_params = list(inspect.signature(theirs.ServerDistillationTrainer.__init__).parameters)[1:]
    assert params[: len(trl_params)] == trl_params
