"""models/scored_positions.py: the last layer computed at the read positions only gives the stock classifier's scores
and gradients (float64, element by element), through the reward trainer's layouts too; every model or setting it
does not support runs the whole forward, and says so."""

import pytest
import torch
import transformers
from transformers import AutoModelForSequenceClassification

from posttrain.models.scored_positions import scored_hidden, why_not
from posttrain.models.tiny import build_tiny_tokenizer, tiny_config

SIZES = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8)


def _classifier(family, layers=2, seed=0, implementation="sdpa", **settings):
    tokenizer = build_tiny_tokenizer()
    if family in ("gemma", "gemma2", "qwen2_moe"):  # (families FAMILIES in models/tiny.py does not build)
        names = {"gemma": "GemmaConfig", "gemma2": "Gemma2Config", "qwen2_moe": "Qwen2MoeConfig"}
        config = getattr(transformers, names[family])(
            vocab_size=len(tokenizer), num_hidden_layers=layers, pad_token_id=tokenizer.pad_token_id, **SIZES
        )
        for key, value in settings.items():
            setattr(config, key, value)
    else:
        config = tiny_config(tokenizer, family, 32, layers, True, **settings)
    config.num_labels = 1
    torch.manual_seed(seed)
    experts = {"experts_implementation": "eager"} if "moe" in family or family == "mixtral" else {}  # (float64)
    model = AutoModelForSequenceClassification.from_config(config, attn_implementation=implementation, **experts)
    return model.double(), tokenizer


def _batch(pad_id, lengths=(9, 5, 12, 3), vocab=100, seed=1):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.full((len(lengths), max(lengths)), pad_id)
    mask = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    for row, length in enumerate(lengths):
        ids[row, :length] = torch.randint(5, vocab, (length,), generator=generator)
        mask[row, :length] = 1
    return ids, mask


def _scores_and_reason(model, inputs, where, head=None):
    hidden, reason = scored_hidden(model, model.base_model if head is None else head[0], inputs, where)
    return (model.score if head is None else head[1])(hidden).squeeze(-1), reason


def _check_against_stock(model, expect_reason=None, extra=None, head=None):
    """Scores and gradients of every parameter equal the stock classifier's, element by element."""
    pad_id = (head[0] if head else model).config.pad_token_id
    ids, mask = _batch(pad_id)
    inputs = {"input_ids": ids, "attention_mask": mask, **(extra or {})}
    params = [p for p in model.parameters() if p.requires_grad]
    reference = model(**inputs).logits.squeeze(-1)
    expected = torch.autograd.grad(reference.pow(2).sum(), params, allow_unused=True)
    last = (torch.arange(ids.shape[1]) * (ids != pad_id)).argmax(-1)
    where = torch.arange(ids.numel()).view_as(ids)[torch.arange(len(ids)), last]
    scores, reason = _scores_and_reason(model, inputs, where, head)
    assert reason == expect_reason
    torch.testing.assert_close(scores, reference, rtol=1e-12, atol=1e-12)
    got = torch.autograd.grad(scores.pow(2).sum(), params, allow_unused=True)
    for g, e in zip(got, expected):
        assert (g is None) == (e is None)
        if g is not None:
            torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("layers", [1, 3])
def test_scores_and_gradients_equal_the_stock_classifier(family, layers, implementation):
    settings = {"sliding_window": None} if family == "mistral" else {}
    model, _ = _classifier(family, layers, implementation=implementation, **settings)
    assert why_not(model, model.model) is None
    _check_against_stock(model)


@pytest.mark.parametrize(
    ("family", "settings", "reason"),
    [
        ("gemma", {}, "unknown decoder"),  # (scaled embeddings)
        ("gemma2", {}, "the last layer is not a recognised pre-norm layer"),  # sandwich norms, soft-capping
        ("gemma3", {}, "the last layer is not a recognised pre-norm layer"),
        ("mistral", {}, "sliding-window or alternating attention"),  # window of 8 on every layer
        (
            "qwen2",
            {"layer_types": ["full_attention", "sliding_attention"], "sliding_window": 4, "use_sliding_window": True},
            "sliding-window or alternating attention",
        ),
        ("mixtral", {}, "its MLP is MoE or unknown"),
        ("qwen2_moe", {"num_experts": 4, "num_experts_per_tok": 2}, "its MLP is MoE or unknown"),
        ("phi3", {}, "the last layer is not a recognised pre-norm layer"),  # (residual dropouts)
        ("llama", {"output_hidden_states": True}, "attentions or hidden states requested"),
    ],
)
def test_what_it_does_not_support_runs_the_whole_forward(family, settings, reason):
    model, _ = _classifier(family, implementation="eager" if family == "gemma2" else "sdpa", **settings)
    assert why_not(model, model.model) == reason
    _check_against_stock(model, reason)


def test_other_attention_implementations_and_requests_fall_back():
    model, _ = _classifier("llama")
    model.config._attn_implementation = "flex_attention"
    assert why_not(model, model.model) == "attention 'flex_attention'"
    model.config._attn_implementation = "sdpa"
    _check_against_stock(model, "attentions or hidden states requested", {"output_hidden_states": True})


def test_gradient_checkpointing_falls_back():
    model, _ = _classifier("llama")
    model.gradient_checkpointing_enable()
    model.train()
    _check_against_stock(model, "gradient checkpointing")


def test_a_peft_model_falls_back():
    peft = pytest.importorskip("peft")
    model, _ = _classifier("llama")
    wrapped = peft.get_peft_model(
        model, peft.LoraConfig(r=2, target_modules=["q_proj", "down_proj"], task_type="SEQ_CLS")
    )
    for name, parameter in wrapped.named_parameters():
        if "lora_B" in name:  # (non-zero, so that the adapters change the scores)
            torch.nn.init.normal_(parameter, std=0.1)
    decoder = wrapped.base_model.model.model
    assert why_not(wrapped, decoder) == "a PEFT adapter"
    _check_against_stock(wrapped, "a PEFT adapter", head=(decoder, wrapped.base_model.model.score))


def test_a_ddp_wrapper_falls_back(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    try:
        model, _ = _classifier("llama")
        wrapped = torch.nn.parallel.DistributedDataParallel(model)
        assert why_not(wrapped, model.model) == "a DDP or DataParallel wrapper"
        _check_against_stock(wrapped, "a DDP or DataParallel wrapper", head=(model.model, model.score))
    finally:
        dist.destroy_process_group()


def test_fsdp2_and_zero3_fall_back(tmp_path):
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    try:
        model, _ = _classifier("llama")
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        assert why_not(model, model.model) == "FSDP, DeepSpeed or torch.compile"
        ids, mask = _batch(model.config.pad_token_id)
        with torch.no_grad():
            reference = model(input_ids=ids, attention_mask=mask).logits.squeeze(-1)
            last = (torch.arange(ids.shape[1]) * (ids != model.config.pad_token_id)).argmax(-1)
            where = torch.arange(ids.numel()).view_as(ids)[torch.arange(len(ids)), last]
            scores, reason = _scores_and_reason(model, {"input_ids": ids, "attention_mask": mask}, where)
        assert reason == "FSDP, DeepSpeed or torch.compile"
        torch.testing.assert_close(scores, reference, rtol=1e-12, atol=1e-12)
    finally:
        dist.destroy_process_group()
    zero3, _ = _classifier("llama")
    zero3.model.layers[0].mlp.up_proj.weight.ds_id = 0  # how DeepSpeed marks a partitioned parameter
    assert why_not(zero3, zero3.model) == "DeepSpeed ZeRO-3 parameters"


def test_the_config_is_restored_on_errors_too():
    model, _ = _classifier("llama")
    model.model.layers[-1].mlp.register_forward_pre_hook(lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
    ids, mask = _batch(model.config.pad_token_id)
    with pytest.raises(RuntimeError, match="boom"):
        scored_hidden(model, model.model, {"input_ids": ids, "attention_mask": mask}, torch.tensor([0]))
    assert model.config._attn_implementation == "sdpa"
    assert model.model.layers[-1].self_attn.config._attn_implementation == "sdpa"


def test_under_a_4d_shared_prompt_mask_each_read_position_sees_only_its_sequence():
    """Two sequences sharing a prompt in one row (the reward trainer's layout): each score equals the sequence's
    own forward alone."""
    model, _ = _classifier("qwen2")
    prompt, first, second = [7, 8, 9, 10], [11, 12, 13], [14, 15]
    ids = torch.tensor([prompt + first + second])
    positions = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 4, 5]])
    segment = torch.tensor([0, 0, 0, 0, 1, 1, 1, 2, 2])
    causal = torch.arange(9)[None, :] <= torch.arange(9)[:, None]
    allowed = causal & ((segment[None, :] == 0) | (segment[None, :] == segment[:, None]))
    inputs = {"input_ids": ids, "position_ids": positions, "attention_mask": allowed[None, None]}
    scores, reason = _scores_and_reason(model, inputs, torch.tensor([6, 8]))
    assert reason is None
    alone = [model(input_ids=torch.tensor([prompt + s])).logits[0, 0] for s in (first, second)]
    torch.testing.assert_close(scores, torch.stack(alone), rtol=1e-12, atol=1e-12)


def test_reward_trainer_scores_equal_the_stock_classifier(tmp_path):
    """The trainer's own `_scores` (shared-prompt layout or padded rows, last layer at the scored positions)."""
    from datasets import Dataset

    from posttrain import RewardConfig, RewardTrainer

    model, tokenizer = _classifier("qwen2", seed=3)
    rows = [
        {"prompt": "the sky is", "chosen": " blue" * (1 + i % 3), "rejected": " red green" * (1 + i % 2)}
        for i in range(8)
    ]
    args = RewardConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=8,
        max_steps=1,
        report_to="none",
        use_cpu=True,
        bf16=False,
        write_report=False,
        save_strategy="no",
    )
    trainer = RewardTrainer(model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tokenizer)
    batch = next(iter(trainer.get_train_dataloader()))
    scores = trainer._scores(trainer.model, batch["input_ids"], batch["attention_mask"])
    reference = trainer.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    torch.testing.assert_close(scores, reference.squeeze(-1), rtol=1e-10, atol=1e-12)
