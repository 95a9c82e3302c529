"""The online round's phases (posttrain.online.phases) on their own: ScoredGroups' selection and concatenation, the
group size per mode, the padded rollout built from hand-made episodes, the per-process share and the optimizer
steps' token totals, on a stub trainer (no model, no generation backend)."""

from types import SimpleNamespace

import pytest
import torch

from posttrain.online.phases import RoundPhases, ScoredGroups
from posttrain.online.rollout import PROMPT_IDS_COLUMN, Episode


class _Accelerator:
    def __init__(self, processes: int = 1, index: int = 0):
        self.num_processes, self.process_index, self.device = processes, index, torch.device("cpu")

    def gather(self, values):
        return torch.cat([values] * self.num_processes)  # every process holds the same values here


class _Phases(RoundPhases):
    def __init__(self, processes: int = 1, index: int = 0, **settings):
        defaults = dict(
            num_generations=4,
            num_generations_eval=None,
            optimizer_steps_per_generation=1,
            num_iterations=1,
            pad_to_multiple_of=None,
            greedy=False,
            mask_truncated_completions=False,
            gradient_accumulation_steps=2,
        )
        self.args = SimpleNamespace(**{**defaults, **settings})
        self.accelerator = _Accelerator(processes, index)
        self.processing_class = SimpleNamespace(pad_token_id=0)
        self.state = SimpleNamespace(global_step=7)
        self.micro_batch_size = 1


def _scored() -> ScoredGroups:
    # 3 prompts, 2 episodes each (prompt-major): episode i has reward i and one reward function's column 10 * i
    episodes = [Episode([i], [1], None, True) for i in range(6)]
    return ScoredGroups(
        rows=[{"p": g} for g in range(3)],
        episodes=episodes,
        prompts=[f"p{i // 2}" for i in range(6)],
        texts=[f"t{i}" for i in range(6)],
        rewards=torch.arange(6.0),
        per_function=10 * torch.arange(6.0).unsqueeze(1),
        timings={"generate": 1.0},
        extra={"note": list("abcdef")},
    )


def test_groups_selects_whole_groups_in_the_order_asked():
    part = _scored().groups([2, 0])
    assert part.rows == [{"p": 2}, {"p": 0}]
    assert [e.token_ids for e in part.episodes] == [[4], [5], [0], [1]]
    assert part.texts == ["t4", "t5", "t0", "t1"] and part.prompts == ["p2", "p2", "p0", "p0"]
    assert part.rewards.tolist() == [4.0, 5.0, 0.0, 1.0]
    assert part.per_function[:, 0].tolist() == [40.0, 50.0, 0.0, 10.0]
    assert part.extra == {"note": ["e", "f", "a", "b"]}


def test_concat_adds_timings_and_fills_a_column_one_part_lacks():
    first, second = _scored().groups([0]), _scored().groups([1])
    second.extra = {}
    second.timings = {"generate": 2.0, "score": 0.5}
    whole = ScoredGroups.concat([first, second])
    assert whole.rewards.tolist() == [0.0, 1.0, 2.0, 3.0]
    assert whole.timings == {"generate": 3.0, "score": 0.5}
    assert whole.extra == {"note": ["a", "b", None, None]}
    assert len(whole.rows) == 2 and len(whole.episodes) == 4


def test_group_size_per_mode_and_when_old_logps_are_needed():
    phases = _Phases()
    assert phases.group_size("train") == phases.group_size("eval") == 4
    assert _Phases(num_generations_eval=2).group_size("eval") == 2
    assert _Phases(num_generations_eval=2).group_size("train") == 4
    assert not phases.needs_old_logps
    assert _Phases(optimizer_steps_per_generation=2).needs_old_logps
    assert _Phases(num_iterations=2).needs_old_logps


def _episodes():
    return [
        Episode([5, 6, 7], [1, 1, 1], [-0.1, -0.2, -0.3], True),
        Episode([8, 9], [1, 0], [-0.4, 0.0], False, info={"policy_version": 3}),  # a tool token, cut off
        Episode([4], [1], [-0.5], True, prompt_ids=[30, 31, 32]),  # its own prompt (an environment's)
    ]


def test_build_rollout_pads_prompts_left_and_completions_right():
    rows = [{PROMPT_IDS_COLUMN: [20]}, {PROMPT_IDS_COLUMN: [21, 22]}]
    rollout = _Phases().build_rollout(0, rows, 2, _episodes(), torch.tensor([1.0, 2.0, 3.0]), torch.ones(3, 1))
    # episodes 0 and 1 take row 0's prompt (i // n), episode 2 its own
    assert rollout.prompt_ids.tolist() == [[0, 0, 20], [0, 0, 20], [30, 31, 32]]
    assert rollout.prompt_mask.tolist() == [[0, 0, 1], [0, 0, 1], [1, 1, 1]]
    assert rollout.completion_ids.tolist() == [[5, 6, 7], [8, 9, 0], [4, 0, 0]]
    assert rollout.completion_mask.tolist() == [[1, 1, 1], [1, 1, 0], [1, 0, 0]]
    assert rollout.model_mask.tolist() == [[1, 1, 1], [1, 0, 0], [1, 0, 0]]
    assert rollout.loss_mask.tolist() == rollout.model_mask.tolist()
    assert rollout.finished.tolist() == [True, False, True]
    assert rollout.sampler_logps.flatten().tolist() == pytest.approx([-0.1, -0.2, -0.3, -0.4, 0.0, 0.0, -0.5, 0, 0])
    assert rollout.policy_version == 7  # the first episode's, else the trainer's step
    assert rollout.num_generations == 2


def test_build_rollout_masks_truncated_and_stale_episodes_and_drops_greedy_logps():
    episodes = _episodes()
    episodes[2].info["stale"] = True
    phases = _Phases(mask_truncated_completions=True, greedy=True, pad_to_multiple_of=4)
    rows = [{PROMPT_IDS_COLUMN: [20]}, {PROMPT_IDS_COLUMN: [21]}]
    rollout = phases.build_rollout(1, rows, 2, episodes, torch.zeros(3), torch.zeros(3, 1))
    assert rollout.completion_ids.shape == (3, 4) and rollout.prompt_ids.shape == (3, 4)
    assert rollout.loss_mask.tolist() == [[1, 1, 1, 0], [0, 0, 0, 0], [0, 0, 0, 0]]
    assert rollout.sampler_logps is None


def test_pad_multiple_auto_is_none_off_neuron():
    assert _Phases(pad_to_multiple_of="auto").pad_multiple is None
    assert _Phases(pad_to_multiple_of=8).pad_multiple == 8


def test_local_share_is_this_process_rows():
    values = torch.arange(6.0)
    assert _Phases(processes=2, index=1).local_share(values).tolist() == [3.0, 4.0, 5.0]
    assert _Phases(processes=3, index=0).local_share(values).tolist() == [0.0, 1.0]


def test_step_token_totals_sum_each_optimizer_step_over_processes_at_least_one():
    # 4 completions, micro-batch 1 x 2 accumulation steps: two optimizer steps of two completions each
    rollout = SimpleNamespace(loss_mask=torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0], [0, 0, 0]]))
    assert _Phases()._step_token_totals(rollout) == [3.0, 1.0]  # the empty step counts 1, its loss stays 0
    assert _Phases(processes=2)._step_token_totals(rollout) == [6.0, 1.0]
