"""Trains every posttrain trainer for 3 SGD steps in this process and saves what it logged and the resulting full
parameters; tests/dist/test_equivalence.py runs it once in one process (per-device batch 2b) and once per engine
under `accelerate launch --config_file examples/accelerate_configs/<engine>.yaml` (2 processes, batch b).

Usage: python worker.py OUT_DIR PER_DEVICE_BATCH TRAINERS MODEL TEACHER REWARD_MODEL
Writes OUT_DIR/<trainer>.rank<r>.pt; a trainer that fails writes its traceback instead, and the others still run.
"""

from __future__ import annotations

import os
import resource
import sys
import traceback

import torch
from datasets import Dataset

STEPS = 3
LEARNING_RATE = 0.5
WORDS = ["red", "green", "blue", "cat", "dog", "sun", "moon", "tree"]


def _common(out_dir: str, per_device: int) -> dict:
    return dict(output_dir=out_dir, per_device_train_batch_size=per_device, max_steps=STEPS, learning_rate=LEARNING_RATE,
                optim="sgd", lr_scheduler_type="constant", max_grad_norm=0.0, logging_steps=1, seed=0,
                report_to="none", save_strategy="no", disable_tqdm=True, write_report=False,
                bf16=False)  # float32: the processes must compute what one process does, to 1e-5


def _prompt_completion(n: int = 24) -> Dataset:
    """Completions of very different lengths: averaging per process instead of per token would show."""
    return Dataset.from_list([{"prompt": f"say {WORDS[i % 8]} {i}", "completion": " " + " ".join(WORDS[: 1 + (5 * i) % 8])}
                              for i in range(n)])


def _preference(n: int = 24) -> Dataset:
    return Dataset.from_list([{"prompt": f"name {WORDS[i % 8]} {i}", "chosen": " " + " ".join(WORDS[: 1 + i % 5]),
                               "rejected": " " + " ".join(WORDS[::-1][: 1 + (3 * i) % 7])} for i in range(n)])


def _unpaired(n: int = 24) -> Dataset:
    return Dataset.from_list([{"prompt": f"name {WORDS[i % 8]} {i}", "completion": " " + " ".join(WORDS[: 1 + i % 6]),
                               "label": i % 3 != 0} for i in range(n)])


def _prompts(n: int = 24) -> Dataset:
    return Dataset.from_list([{"prompt": f"{WORDS[i % 8]} {i} and {WORDS[(3 * i) % 8]}"} for i in range(n)])


def low_id_fraction(completion_ids, **kwargs):
    """The fraction of a completion's tokens with an id below 192 (about half of them for the random model)."""
    return [sum(t < 192 for t in ids) / max(len(ids), 1) for ids in completion_ids]


def _stopping_model(path: str):
    """The tiny model with many stop tokens, so that completions end early and differ in length."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path)
    model.generation_config.eos_token_id = [model.generation_config.eos_token_id, *range(100, 140)]
    return model


def build(name: str, out_dir: str, per_device: int, model: str, teacher: str, reward_model: str, **overrides):
    """`overrides`: training arguments that replace the common ones (checkpoint_worker.py saves and resumes)."""
    import posttrain as pt

    common = {**_common(os.path.join(out_dir, name), per_device), **overrides}
    online = dict(max_completion_length=6, temperature=1.0)
    if name in ("grpo", "rloo", "ppo"):
        # posttrain generates a prompt's whole group on one process: b=4 puts one group of 4 on each process
        common["per_device_train_batch_size"] = 2 * per_device
    if name == "sft":
        return pt.SFTTrainer(model, args=pt.SFTConfig(max_length=64, **common), train_dataset=_prompt_completion())
    if name == "dpo":
        return pt.DPOTrainer(model, args=pt.DPOConfig(max_length=64, **common), train_dataset=_preference())
    if name == "dpo_epochs":  # 8 rows: step 3 starts a second epoch, whose rows' reference values are known
        return pt.DPOTrainer(model, args=pt.DPOConfig(max_length=64, **common), train_dataset=_preference(8))
    if name == "dpo_sync":  # TR-DPO: the policy is mixed into the (sharded) reference after every step
        return pt.DPOTrainer(model, train_dataset=_preference(), args=pt.DPOConfig(
            max_length=64, sync_ref_model=True, ref_model_sync_steps=1, ref_model_mixup_alpha=0.5, **common))
    if name == "kto":
        return pt.KTOTrainer(model, args=pt.KTOConfig(max_length=64, **common), train_dataset=_unpaired())
    if name == "reward":
        return pt.RewardTrainer(reward_model, args=pt.RewardConfig(max_length=64, **common),
                                train_dataset=_preference())
    if name == "grpo":
        return pt.GRPOTrainer(_stopping_model(model), low_id_fraction, train_dataset=_prompts(),
                              args=pt.GRPOConfig(num_generations=4, beta=0.1, **online, **common))
    if name == "rloo":
        return pt.RLOOTrainer(_stopping_model(model), low_id_fraction, train_dataset=_prompts(),
                              args=pt.RLOOConfig(num_generations=4, beta=0.1, **online, **common))
    if name == "ppo":  # the value model is a copy of the reward model
        return pt.PPOTrainer(_stopping_model(model), reward_model, train_dataset=_prompts(),
                             args=pt.PPOConfig(num_generations=1, num_ppo_epochs=1, **online, **common))
    if name == "distillation":
        return pt.DistillationTrainer(model, teacher, train_dataset=_prompt_completion(),
                                      args=pt.DistillationConfig(max_length=64, lmbda=0.0, alpha=0.5, **common))
    raise ValueError(name)


def placement(model) -> str | None:
    """How a model's parameters are held in this process: 'zero3' (DeepSpeed partitions), 'fsdp2' (DTensor
    shards), 'replicated' (plain tensors), or None without a model."""
    if model is None:
        return None
    params = list(model.parameters())
    if any(hasattr(p, "ds_id") for p in params):
        return "zero3"
    if any(type(p).__name__ == "DTensor" or type(getattr(p, "data", None)).__name__ == "DTensor" for p in params):
        return "fsdp2"
    return "replicated"


def full_parameters(model) -> dict[str, torch.Tensor]:
    """Every trainable parameter in full, whatever holds it (ZeRO-3 partitions, FSDP2 DTensors, DDP)."""
    model = getattr(model, "module", model)  # the DeepSpeed engine / DDP wrapper
    out = {}
    for name, param in model.named_parameters():
        if hasattr(param, "ds_id"):
            import deepspeed

            with deepspeed.zero.GatheredParameters([param]):
                out[name] = param.detach().clone().float()
        elif hasattr(param, "full_tensor"):
            out[name] = param.full_tensor().detach().clone().float()
        else:
            out[name] = param.detach().clone().float()
    return {n.replace("_orig_mod.", ""): v for n, v in out.items()}


def record(name: str, trainer) -> dict:
    from posttrain.runtime.distributed import held_parameter_count

    logs = [h for h in trainer.state.log_history if "loss" in h]
    rollout = getattr(trainer, "rollout", None)
    result = {
        "world_size": trainer.accelerator.num_processes,
        "distributed_type": str(trainer.accelerator.distributed_type),
        "loss": [h["loss"] for h in logs],
        "logs": logs,
        "params": full_parameters(trainer.model_wrapped),
        "policy": placement(trainer.model_wrapped),
    }
    for attr in ("ref_model", "teacher_model", "value_model"):
        if getattr(trainer, attr, None) is not None:
            result[attr] = placement(getattr(trainer, attr))
            result[attr + "_numel"] = held_parameter_count(getattr(trainer, attr))
    scorer = getattr(trainer, "reward_scorer", None)
    scorer_models = [r.func.model for r in getattr(scorer, "_rewards", []) if hasattr(r.func, "model")]
    if scorer_models:
        result["reward_model"] = placement(scorer_models[0])
        result["reward_model_numel"] = held_parameter_count(scorer_models[0])
    if rollout is not None and "advantages" in getattr(rollout, "tensors", {}):
        result["advantages"] = rollout.tensors["advantages"].detach().clone()
    return result


def main() -> None:
    out_dir, per_device, names, model, teacher, reward_model = sys.argv[1:7]
    rank = int(os.environ.get("RANK", "0"))
    os.makedirs(out_dir, exist_ok=True)
    for name in names.split(","):
        try:
            trainer = build(name, out_dir, int(per_device), model, teacher, reward_model)
            initial = full_parameters(trainer.model)
            trainer.train()
            result = record(name, trainer)
            result["moved"] = max((result["params"][n] - p).abs().max().item() for n, p in initial.items())
        except Exception:  # one trainer's failure must not hide the others' results
            result = {"error": traceback.format_exc()}
        result["max_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # this process's peak so far
        torch.save(result, os.path.join(out_dir, f"{name}.rank{rank}.pt"))
        if torch.distributed.is_initialized():
            torch.distributed.barrier()


if __name__ == "__main__":
    main()
