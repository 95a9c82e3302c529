"""The helpers at TRL's `trl.trainer.utils` / `trl.models.utils` / `trl.import_utils` paths (posttrain.trainer.utils,
posttrain.models.utils, posttrain.import_utils), each checked against a hand-computed or directly computed value."""

import functools
import importlib
import io
import pickle

import pytest
import torch
from datasets import IterableDataset

from posttrain.trainer import utils


def test_the_trl_module_paths_import():
    for path in (
        "posttrain.import_utils",
        "posttrain.models.utils",
        "posttrain.trainer.utils",
        "posttrain.trainer.base_config",
        "posttrain.trainer.callbacks",
        "posttrain.trainer.model_config",
        "posttrain.rewards.accuracy_rewards",
        "posttrain.rewards.format_rewards",
        "posttrain.rewards.other_rewards",
        *(
            f"posttrain.trainer.{m}_{kind}"
            for m in ("sft", "dpo", "kto", "reward", "grpo", "rloo", "distillation")
            for kind in ("config", "trainer")
        ),
    ):
        importlib.import_module(path)
    from posttrain.trainer.base_config import _BaseConfig
    from posttrain.trainers.grpo_config import GRPOConfig
    from posttrain.trainers.sft_config import SFTConfig

    assert issubclass(SFTConfig, _BaseConfig) and issubclass(GRPOConfig, _BaseConfig)


def test_import_utils_answer_without_importing():
    from posttrain import import_utils

    assert import_utils.is_jmespath_available() is (importlib.util.find_spec("jmespath") is not None)
    assert import_utils.is_liger_kernel_available() is (importlib.util.find_spec("liger_kernel") is not None)
    from posttrain.runtime.packages import is_package_available

    assert is_package_available("torch", min_version="1.0") and not is_package_available("torch", "999.0")


def test_cli_main_is_the_entry_function():
    from posttrain.cli import main

    assert callable(main) and main.__module__ == "posttrain.cli.main"


def test_pad_both_sides_and_multiple():
    a, b = torch.tensor([[1, 2], [3, 4]]), torch.tensor([[5]])
    assert utils.pad([a, b], padding_value=9).tolist() == [[[1, 2], [3, 4]], [[5, 9], [9, 9]]]
    assert utils.pad([a, b], padding_value=9, padding_side="left").tolist() == [[[1, 2], [3, 4]], [[9, 9], [9, 5]]]
    x, y = torch.tensor([1, 2, 3, 4, 5]), torch.tensor([6])
    assert utils.pad([x, y], 0, "right", pad_to_multiple_of=3).tolist() == [[1, 2, 3, 4, 5, 0], [6, 0, 0, 0, 0, 0]]


def test_flush_left_moves_kept_tokens_and_drops_empty_columns():
    mask = torch.tensor([[0, 1, 0, 1], [0, 0, 1, 0]])
    ids = torch.tensor([[7, 8, 7, 9], [7, 7, 5, 7]])
    new_mask, new_ids = utils.flush_left(mask, ids)
    assert new_mask.tolist() == [[1, 1], [1, 0]] and new_ids.tolist() == [[8, 9], [5, 0]]
    assert utils.flush_left(mask).tolist() == [[1, 1], [1, 0]]


def test_split_and_shuffle_dicts():
    batch = {"x": torch.arange(10).reshape(5, 2), "s": torch.tensor(3.0), "n": None, "names": list("abcde")}
    chunks = utils.split_tensor_dict(batch, 2)
    assert [c["x"].shape[0] for c in chunks] == [3, 2] and chunks[1]["names"] == ["d", "e"]
    assert all(c["s"] is batch["s"] and c["n"] is None for c in chunks)
    shuffled = utils.shuffle_sequence_dict(batch, generator=torch.Generator().manual_seed(0))
    assert [row[0] // 2 for row in shuffled["x"].tolist()] == ["abcde".index(n) for n in shuffled["names"]]
    assert sorted(shuffled["names"]) == list("abcde") and shuffled["n"] is None


def test_pixel_values_split_and_unsplit_round_trip():
    batch = {
        "image_grid_thw": torch.tensor([[1, 1, 2], [1, 2, 2], [1, 1, 1]]),
        "num_images": [2, 1],
        "pixel_values": torch.arange(7 * 2).reshape(7, 2),
    }
    split = utils.split_pixel_values_by_grid(batch)
    assert [len(p) for p in split["pixel_values"]] == [6, 1] and [len(g) for g in split["image_grid_thw"]] == [2, 1]
    merged = utils.unsplit_pixel_values_by_grid(split)
    assert torch.equal(merged["pixel_values"], batch["pixel_values"])
    assert torch.equal(merged["image_grid_thw"], batch["image_grid_thw"])
    with pytest.raises(ValueError):
        utils.split_pixel_values_by_grid({**batch, "pixel_values": torch.zeros(5, 2)})
    tiles = {"num_images": [1, 3], "num_tiles": [2, 4], "pixel_values": torch.zeros(6, 1)}
    assert [len(p) for p in utils.split_pixel_values_by_grid(tiles)["pixel_values"]] == [2, 4]


def test_repeat_sampler_order_and_length():
    sampler = utils.RepeatSampler(range(5), mini_repeat_count=2, batch_size=2, repeat_count=2, shuffle=False)
    assert list(sampler) == [0, 0, 1, 1, 0, 0, 1, 1, 2, 2, 3, 3, 2, 2, 3, 3]  # index 4 cannot fill a batch
    assert len(sampler) == 16
    shuffled = list(utils.RepeatSampler(range(6), mini_repeat_count=3, seed=1))
    assert sorted(set(shuffled)) == list(range(6)) and all(len(set(shuffled[i : i + 3])) == 1 for i in (0, 3, 6))


def test_repeat_iterable_dataset_matches_the_sampler():
    stream = IterableDataset.from_generator(lambda: ({"x": i, "msg": [{"content": str(i)}]} for i in range(7)))
    repeated = list(utils.repeat_iterable_dataset(stream, mini_repeat_count=2, batch_size=3, repeat_count=2))
    expected = list(utils.RepeatSampler(range(7), mini_repeat_count=2, batch_size=3, repeat_count=2, shuffle=False))
    assert [r["x"] for r in repeated] == expected
    assert repeated[0]["msg"] is not repeated[1]["msg"]  # each repeat its own object


def test_log_softmax_gather_entropy_and_nan_reductions():
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 11, dtype=torch.float64)
    index = torch.randint(0, 11, (2, 3))
    expected = logits.log_softmax(-1).gather(-1, index[..., None])
    assert torch.allclose(utils.selective_log_softmax(logits, index), expected[..., 0])
    wide = torch.randint(0, 11, (2, 3, 4))
    assert torch.allclose(utils.selective_log_softmax(logits, wide), logits.log_softmax(-1).gather(-1, wide))
    half = logits.to(torch.bfloat16)
    assert torch.equal(
        utils.selective_log_softmax(half, index), half.log_softmax(-1).gather(-1, index[..., None])[..., 0]
    )
    masked = utils.selective_log_softmax(logits, index, row_mask=torch.tensor([[True, False, True]] * 2))
    assert masked[:, 1].eq(0).all() and torch.allclose(masked[:, 0], expected[:, 0, 0])
    p = logits.softmax(-1)
    assert torch.allclose(utils.entropy_from_logits(logits, chunk_size=2), -(p * p.log()).sum(-1))
    values = torch.tensor([[1.0, float("nan"), 3.0], [float("nan")] * 3])
    assert utils.nanstd(values[0]).item() == pytest.approx(2**0.5)
    assert torch.isnan(utils.nanstd(values, dim=1))[1] and utils.nanmax(values).item() == 3.0
    assert utils.nanmin(values[0]).item() == 1.0 and torch.isnan(utils.nanmin(values[1]))


def test_callable_names_and_hash_module():
    def reward(completions, scale):
        return completions

    class Scorer:
        def __call__(self, completions):
            return completions

    assert utils.get_callable_name(functools.partial(functools.partial(reward), scale=2)) == "reward"
    assert utils.get_callable_name(Scorer()) == "Scorer"
    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    b.load_state_dict(a.state_dict())
    assert utils.hash_module(a) == utils.hash_module(b)
    with torch.no_grad():
        b.bias.add_(1e-3)
    assert utils.hash_module(a) != utils.hash_module(b) != utils.hash_module(b.half())


def test_flops_and_mfu():
    from transformers import Qwen3Config, Qwen3MoeConfig

    dense = Qwen3Config(
        vocab_size=100,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=4,
        tie_word_embeddings=True,
    )
    params = 2 * (16 * 16 * 2 + 16 * 8 * 2 + 3 * 16 * 32)  # q, o; k, v; gate, up, down (tied head not counted)
    assert utils.compute_flops_per_token(dense, 10) == 6 * params + 12 * 2 * 4 * 4 * 10
    dense.tie_word_embeddings = False
    assert utils.compute_flops_per_token(dense, 10) == 6 * (params + 100 * 16) + 12 * 2 * 4 * 4 * 10
    moe = Qwen3MoeConfig(
        vocab_size=100,
        hidden_size=16,
        moe_intermediate_size=8,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        tie_word_embeddings=True,
    )
    moe.num_experts_per_tok = 1
    one = utils.compute_flops_per_token(moe, 10)
    moe.num_experts_per_tok = 2
    two = utils.compute_flops_per_token(moe, 10)
    assert two - one == 6 * 2 * 3 * 16 * 8  # one more active expert in each of the 2 layers
    assert utils.compute_mfu(1e9, 100.0, 2, peak_flops_per_device=1e11) == pytest.approx(50.0)
    full = utils.compute_flops_per_token(dense, 10)
    assert utils.adjusted_mfu(50.0, dense, 10) == pytest.approx(50.0 * (full - 6 * 2 * 4 * 4 * 10) / full)
    assert utils.get_peak_flops("NVIDIA H100 80GB HBM3") == 989.5e12 and utils.get_peak_flops("NVIDIA L40S") == 362e12


def test_model_card_names_its_parts():
    card = str(
        utils.generate_model_card(
            base_model="org/base",
            model_name="tuned",
            hub_model_id="me/tuned",
            dataset_name="org/data",
            tags=["x"],
            wandb_url="https://wandb.ai/r",
            trackio_url=None,
            trainer_name="SFT",
            trainer_citation="@misc{k}",
            paper_title="Paper",
            paper_id="2401.00001",
            comet_url=None,
        )
    )
    for part in (
        "[org/base](https://huggingface.co/org/base)",
        'model="me/tuned"',
        "datasets: org/data",
        "(https://wandb.ai/r)",
        "```bibtex\n@misc{k}\n```",
        "[Paper](https://huggingface.co/papers/2401.00001)",
    ):
        assert part in card


def test_sample_table_prints_conversations(monkeypatch):
    pytest.importorskip("rich")
    out = io.StringIO()
    monkeypatch.setattr("sys.stdout", out)
    monkeypatch.setenv("COLUMNS", "100")
    prompts = ["plain prompt", [{"role": "user", "content": "hello there"}]]
    completions = ["done", [{"role": "assistant", "thinking": "hmm", "content": "hi"}]]
    utils.print_prompt_completions_sample(
        prompts, completions, {"r": [0.5, 1.0]}, [0.25, -0.25], 7, extra={"k": [1, 2]}
    )
    text = out.getvalue()
    for part in ("Step 7", "plain prompt", "USER", "hello there", "ASSISTANT", "hmm", "0.50", "-0.25", "Advantage"):
        assert part in text


def test_shaping_rewards_survive_pickling_inside_the_face():
    from posttrain.rewards.other_rewards import get_repetition_penalty_reward

    reward = pickle.loads(pickle.dumps(get_repetition_penalty_reward(2)))
    assert reward([[1, 1, 1]]) == [pytest.approx(-0.5)]


def test_env_report_has_trls_version_line():
    """`trl env` prints "TRL version: ..."; scripts and bug-report templates look for that line."""
    from posttrain.cli.environment import environment_report

    last = environment_report().splitlines()[-1]
    assert last.startswith("TRL version: ") and "TRL 1.16's API" in last


def test_vllm_serve_has_trls_path():
    from posttrain.cli.vllm_serve import main
    from posttrain.scripts import vllm_serve

    assert vllm_serve.main is main


def test_language_modeling_collator_layouts():
    from posttrain.trainer.sft_trainer import DataCollatorForLanguageModeling

    rows = [{"input_ids": [5, 6, 7], "completion_mask": [0, 1, 1]}, {"input_ids": [8, 9], "labels": [8, 9]}]
    padded = DataCollatorForLanguageModeling(pad_token_id=1, pad_to_multiple_of=4)(rows)
    assert padded["input_ids"].tolist() == [[5, 6, 7, 1], [8, 9, 1, 1]]
    assert padded["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 1, 0, 0]]
    assert padded["labels"].tolist() == [[-100, 6, 7, -100], [8, 9, -100, -100]]
    packed = [{"input_ids": [5, 6, 7], "seq_lengths": [1, 2]}, {"input_ids": [8, 9]}]
    flat = DataCollatorForLanguageModeling(pad_token_id=1, padding_free=True)(packed)
    assert flat["input_ids"].tolist() == [[5, 6, 7, 8, 9]] and flat["position_ids"].tolist() == [[0, 0, 1, 0, 1]]
    assert flat["labels"].tolist() == [[-100, -100, 7, -100, 9]] and "attention_mask" not in flat
    positions = DataCollatorForLanguageModeling.get_position_ids_from_packed_seq_lengths([[2, 1]])
    assert positions[0].tolist() == [0, 1, 0]


def test_preference_collators_layouts():
    from posttrain.trainer.dpo_trainer import DataCollatorForPreference
    from posttrain.trainer.kto_trainer import DataCollatorForUnpairedPreference

    rows = [
        {
            "prompt_ids": [1],
            "chosen_ids": [2, 3],
            "rejected_ids": [4],
            "ref_chosen_logps": -1.0,
            "ref_rejected_logps": 0,
        },
        {
            "prompt_ids": [5, 6],
            "chosen_ids": [7],
            "rejected_ids": [8, 9],
            "ref_chosen_logps": -2,
            "ref_rejected_logps": -3,
        },
    ]
    batch = DataCollatorForPreference(pad_token_id=0)(rows)
    assert batch["input_ids"].tolist() == [[1, 2, 3, 0], [5, 6, 7, 0], [1, 4, 0, 0], [5, 6, 8, 9]]
    assert batch["completion_mask"].tolist() == [[0, 1, 1, 0], [0, 0, 1, 0], [0, 1, 0, 0], [0, 0, 1, 1]]
    assert batch["ref_rejected_logps"].tolist() == [0.0, -3.0]
    cut = DataCollatorForPreference(pad_token_id=0, max_length=2, truncation_mode="keep_end")(rows)
    assert cut["input_ids"].tolist() == [[2, 3], [6, 7], [1, 4], [8, 9]]
    whole = DataCollatorForPreference(pad_token_id=0)([{"chosen_ids": [1, 2], "rejected_ids": [3], "margin": 0.5}])
    assert whole["input_ids"].tolist() == [[1, 2], [3, 0]] and whole["margin"].tolist() == [0.5]
    assert "completion_mask" not in whole
    unpaired = [
        {"prompt_ids": [1], "completion_ids": [2], "KL_completion_ids": [3, 4], "label": True},
        {"prompt_ids": [5, 6], "completion_ids": [7], "KL_completion_ids": [8], "label": False},
    ]
    kto = DataCollatorForUnpairedPreference(pad_token_id=0)(unpaired)
    assert kto["input_ids"].tolist() == [[1, 2, 0], [5, 6, 7]] and kto["KL_input_ids"].tolist() == [
        [1, 3, 4],
        [5, 6, 8],
    ]
    assert kto["KL_completion_mask"].tolist() == [[0, 1, 1], [0, 0, 1]] and kto["label"].tolist() == [True, False]
