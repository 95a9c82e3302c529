"""Runs TRL's example scripts (examples/scripts/*.py of TRL's repository, beside the tests in ../shared/trl-tests)
offline on tiny stand-ins, 2 optimizer steps each, against TRL as installed (--lib trl) and against posttrain with
the scripts' `trl` imports switched to `posttrain` (--lib posttrain). Driven by scripts/trl_examples.sh.

Each script gets a tiny model of the TRL harness's stand-ins (scripts/trl_suite/standins.py, in the hub cache) and a
data set with the columns it reads: a configuration of the stand-in `trl-internal-testing/zen`, or a small local
JSON-lines set written here. Scripts that need a service or data this machine cannot have are listed in SKIPPED with
the reason. Results: <out>/<lib>.json (one entry per script: status, seconds, last error line) and, with --table, a
markdown table of both libraries side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

POLICY = "trl-internal-testing/tiny-Qwen2ForCausalLM-2.5"
TEACHER = "trl-internal-testing/tiny-Qwen3ForCausalLM"
REWARD = "trl-internal-testing/tiny-Qwen2ForSequenceClassification-2.5"
# the stand-in of trl-internal-testing/zen (standins.py), a local folder with one configuration per data format
ZEN = str(Path(os.environ.get("TRL_SUITE_CACHE", ".cache/trl_suite")) / "datasets" / "zen")
COMMON = [
    "--max_steps", "2", "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "1",
    "--logging_steps", "1", "--save_strategy", "no", "--report_to", "none", "--eval_strategy", "no",
    "--bf16", "false",
]  # fmt: skip
ONLINE = ["--max_new_tokens", "8", "--dtype", "auto"]  # a dtype name other than auto: the scripts save a torch.dtype


def zen(config: str) -> list[str]:
    return ["--dataset_name", ZEN, "--dataset_config", config]


# the online pair methods: the scripts load the reward model from --reward_model_path and pass it as reward_funcs
PAIRED = ["--model_name_or_path", POLICY, "--reward_model_path", REWARD, *zen("standard_prompt_only"), *ONLINE]

# script -> (arguments after the common ones; "{data:<name>}" is replaced by a local stand-in data set's folder)
SCRIPTS: dict[str, list[str]] = {
    "kto.py": ["--model_name_or_path", POLICY, *zen("standard_unpaired_preference")],
    "reward_modeling.py": ["--model_name_or_path", REWARD, *zen("standard_preference")],
    "cpo.py": ["--model_name_or_path", POLICY, *zen("standard_preference"), "--no_remove_unused_columns"],
    "orpo.py": ["--model_name_or_path", POLICY, *zen("standard_preference"), "--no_remove_unused_columns"],
    "tpo.py": ["--model_name_or_path", POLICY, "--dataset_name", "{data:triple}", "--no_remove_unused_columns"],
    "prm.py": ["--model_name_or_path", POLICY, *zen("standard_stepwise_supervision")],
    "gkd.py": [
        "--model_name_or_path", POLICY, "--teacher_model_name_or_path", POLICY,
        *zen("conversational_language_modeling"), "--max_new_tokens", "8",
    ],
    "gold.py": [
        "--model_name_or_path", POLICY, "--teacher_model_name_or_path", POLICY,
        *zen("conversational_language_modeling"), "--max_completion_length", "8",
    ],
    "distillation.py": [
        "--model_name_or_path", POLICY, "--teacher_model_name_or_path", POLICY,
        *zen("conversational_prompt_only"), "--max_completion_length", "8",
    ],
    "online_dpo.py": PAIRED,
    "xpo.py": PAIRED,
    "nash_md.py": PAIRED,
    "sdpo.py": [
        "--model_name_or_path", POLICY, "--dataset_name", "{data:gsm8k}", "--num_generations", "2",
        "--max_completion_length", "8",
    ],
    "sdft.py": [
        "--model_name_or_path", POLICY, "--dataset_name", "{data:sdft}", "--max_completion_length", "8",
        "--num_generations", "2",
    ],
    "sft_vlm.py": ["--model_name_or_path", "{data:vlm_model}", "--dataset_name", "{data:vlm_messages}"],
    "dpo_vlm.py": ["--model_name_or_path", "{data:vlm_model}", "--dataset_name", "{data:vlm_preference}"],
    "mpo_vlm.py": [
        "--model_name_or_path", "{data:vlm_model}", "--dataset_name", "{data:vlm_preference}",
        "--loss_type", "sigmoid", "bco_pair", "sft", "--loss_weights", "0.8", "0.2", "1.0",
    ],
    "sft_vlm_gemma3.py": [
        "--model_name_or_path", "{data:vlm_gemma3_model}", "--dataset_name", "{data:vlm_messages}",
        "--attn_implementation", "eager",
    ],
}  # fmt: skip
SKIPPED = {
    "bco.py": "TRL 1.16 has no trl.experimental.bco (BCO left TRL); the script embeds prompts with "
    "nomic-ai/nomic-embed-text-v1.5, custom model code it loads without trust_remote_code (transformers asks on a "
    "terminal, refuses otherwise), with no stand-in here. posttrain parses its command (--no_remove_unused_columns) "
    "and trains BCO with an embedding model: tests/experimental/test_bco.py",
    "dpo.py": "comments only: the script moved to trl/scripts/dpo.py (`trl dpo`; posttrain.scripts.dpo on posttrain)",
    "sft.py": "comments only: the script moved to trl/scripts/sft.py (`trl sft`; posttrain.scripts.sft on posttrain)",
    "async_grpo.py": "needs a running vLLM server (the rollout worker talks to it over HTTP) and openai/gsm8k",
    "grpo_2048.py": "needs an OpenEnv 2048 environment server",
    "grpo_agent.py": "needs vLLM and the qgallouedec/biogrid databases from the Hub",
    "grpo_continuous_batching.py": "needs a CUDA device (transformers' continuous batching)",
    "ssd.py": "needs vLLM for its self-distillation sampling",
    "ssd_eval.py": "needs vLLM",
    "sft_gpt_oss.py": "needs a CUDA device (MXFP4 kernels) and vLLM",
    "sft_diffusion_gemma.py": "needs a diffusion Gemma checkpoint with no tiny stand-in",
    "sft_nemotron_3.py": "needs a Nemotron-3 checkpoint with no tiny stand-in (mamba kernels)",
    "sft_tiny_aya_tool_calling.py": "needs the tiny-aya checkpoint and its tool-calling data set from the Hub",
    "sft_gemma3.py": "needs open-r1/codeforces-cots from the Hub (a fixed data set id, no stand-in)",
    "gspo.py": "needs AI-MO/NuminaMath-TIR from the Hub (a fixed data set id, no stand-in)",
    "rloo.py": "needs AI-MO/NuminaMath-TIR from the Hub (a fixed data set id, no stand-in)",
    "grpo_vlm.py": "needs lmms-lab/multimodal-open-r1-8k-verified from the Hub (a fixed data set id)",
    "gspo_vlm.py": "needs lmms-lab/multimodal-open-r1-8k-verified from the Hub (a fixed data set id)",
    "rloo_vlm.py": "needs lmms-lab/multimodal-open-r1-8k-verified from the Hub (a fixed data set id)",
    "online_dpo_vlm.py": "needs lmms-lab/multimodal-open-r1-8k-verified from the Hub (a fixed data set id)",
}
# Folders of examples/scripts: OpenEnv, Harbor, OpenReward (environment servers), PPO (its own scripts' set-up).
SKIPPED_FOLDERS = {
    "openenv": "needs OpenEnv environment servers (BrowserGym, CARLA, ...)",
    "harbor": "needs a Harbor sandbox service",
    "openreward": "needs the OpenReward environment service",
    "ppo": "PPO's scripts need value/reward checkpoints from the Hub",
}


def write_datasets(root: Path) -> dict[str, str]:
    """Local JSON-lines data sets (train/test) with the columns of the scripts that read no zen configuration."""
    sets = {
        "triple": [
            {"prompt": f"Count to {i}:", "chosen": " 1 2 3", "rejected": " 3 2 1", "reference": " 1 2 3 4"}
            for i in range(8)
        ],
        "gsm8k": [
            {"question": f"What is {i} + {i}?", "answer": f"{i} and {i} make {2 * i}. #### {2 * i}"} for i in range(8)
        ],
        "sdft": [
            {"prompt": [{"role": "user", "content": f"What is {i} + 1?"}], "golden_response": f"It is {i + 1}.",
             "privileged_context": f"The answer is {i + 1}."}
            for i in range(8)
        ],
    }  # fmt: skip
    paths = write_vision_datasets(root)
    for name, rows in sets.items():
        folder = root / name
        folder.mkdir(parents=True, exist_ok=True)
        for split, part in (("train", rows[:6]), ("test", rows[6:])):
            (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
        paths[name] = str(folder)
    return paths


def write_vision_datasets(root: Path) -> dict[str, str]:
    """A tiny LLaVA and a tiny Gemma 3 (posttrain/models/tiny_vlm.py) and two image data sets (parquet: the Image
    feature survives)."""
    import numpy as np
    from datasets import Dataset
    from PIL import Image

    from posttrain.models.tiny_vlm import build_tiny_gemma3, build_tiny_llava

    def image(i: int):
        return Image.fromarray((np.random.RandomState(i).rand(32, 32, 3) * 255).astype("uint8"))

    def user(i: int) -> list[dict]:
        return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": f"What is {i}?"}]}]

    def assistant(text: str) -> list[dict]:
        return [{"role": "assistant", "content": [{"type": "text", "text": text}]}]

    sets = {
        "vlm_messages": [{"images": [image(i)], "messages": user(i) + assistant(f"digit {i}")} for i in range(8)],
        "vlm_preference": [
            {"images": [image(i)], "prompt": user(i), "chosen": assistant(f"digit {i}"), "rejected": assistant("a cat")}
            for i in range(8)
        ],
    }
    paths = {
        "vlm_model": build_tiny_llava(root / "tiny_llava"),
        "vlm_gemma3_model": build_tiny_gemma3(root / "tiny_gemma3"),
    }
    for name, rows in sets.items():
        folder = root / name
        folder.mkdir(parents=True, exist_ok=True)
        for split, part in (("train", rows[:6]), ("test", rows[6:])):
            Dataset.from_list(part).to_parquet(str(folder / f"{split}.parquet"))
        paths[name] = str(folder)
    return {k: str(v) for k, v in paths.items()}


def switch_imports(source: str) -> str:
    """The script with its `trl` imports taken from posttrain (`from trl... import`, `import trl...`)."""
    source = re.sub(r"^(\s*)from trl(\.|\s)", r"\1from posttrain\2", source, flags=re.M)
    return re.sub(
        r"^(\s*)import trl(\.\S+)?(\s|$)",
        lambda m: f"{m[1]}import {'posttrain' + m[2] + ', ' if m[2] else ''}posttrain as trl{m[3]}",
        source,
        flags=re.M,
    )


def last_error(log: str) -> str:
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    errors = [line for line in lines if re.match(r"^[\w.]*(Error|Exception)\b", line)]
    return (errors or lines or [""])[-1][:300]


def run_one(script: Path, args: list[str], lib: str, work: Path, timeout: int) -> dict:
    folder = work / lib / script.stem
    folder.mkdir(parents=True, exist_ok=True)
    source = script.read_text()
    target = folder / script.name
    target.write_text(switch_imports(source) if lib == "posttrain" else source)
    command = [sys.executable, str(target), *COMMON, *args, "--output_dir", str(folder / "out")]
    start = time.perf_counter()
    try:
        run = subprocess.run(command, cwd=folder, capture_output=True, text=True, timeout=timeout)
        status, log = ("passed" if run.returncode == 0 else "failed"), run.stdout + run.stderr
    except subprocess.TimeoutExpired as expired:
        status, log = "timeout", f"timed out after {timeout} s\n" + str(expired.stderr or "")
    (folder / "log.txt").write_text(log)
    return {
        "status": status,
        "seconds": round(time.perf_counter() - start, 1),
        "error": "" if status == "passed" else last_error(log),
    }


def table(results: dict[str, dict], commit: str) -> str:
    trl_ok = {n for n, r in results.get("trl", {}).items() if r.get("status") == "passed"}
    ours_ok = {n for n, r in results.get("posttrain", {}).items() if r.get("status") == "passed"}
    lines = [
        f"Run {time.strftime('%Y-%m-%d', time.gmtime())} at commit {commit}, TRL 1.16.0 installed, CPU, 2 optimizer "
        "steps each on tiny stand-ins (`bash scripts/trl_examples.sh`).",
        "",
        f"Of the {len(trl_ok)} scripts that run on TRL 1.16 here, {len(trl_ok & ours_ok)} run on posttrain; posttrain "
        f"also runs {len(ours_ok - trl_ok)} that TRL 1.16 cannot ({', '.join(sorted(ours_ok - trl_ok)) or 'none'}).",
        "",
        "| script | TRL 1.16 | posttrain | posttrain's error, or why the script is not run |",
        "|---|---|---|---|",
    ]
    for name in sorted(set(results.get("trl", {})) | set(results.get("posttrain", {}))):
        trl, ours = results.get("trl", {}).get(name, {}), results.get("posttrain", {}).get(name, {})
        if name in SKIPPED:
            trl = ours = {"status": "skipped", "reason": SKIPPED[name]}
        note = ours.get("error") or ours.get("reason") or ""
        if trl.get("error"):
            note = f"{note} (TRL: {trl['error']})".strip()
        cells = [f"{r.get('status', '-')}" + (f" ({r['seconds']} s)" if "seconds" in r else "") for r in (trl, ours)]
        lines.append(f"| `{name}` | {cells[0]} | {cells[1]} | {note.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", required=True, help="examples/scripts folder of TRL's repository")
    parser.add_argument("--lib", choices=("trl", "posttrain"), required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--timeout", type=int, default=600)
    parser.add_argument("scripts", nargs="*", help="script names (default: every script of SCRIPTS)")
    args = parser.parse_args(argv)
    examples, out = Path(args.examples), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="trl_examples."))
    data = write_datasets(work / "data")
    names = args.scripts or sorted(SCRIPTS)
    results = {}
    for name in names:
        if name not in SCRIPTS:
            results[name] = {"status": "skipped", "reason": SKIPPED.get(name, "no stand-in set-up for it")}
            continue
        script_args = [re.sub(r"\{data:(\w+)\}", lambda m: data[m[1]], a) for a in SCRIPTS[name]]
        results[name] = run_one(examples / name, script_args, args.lib, work, args.timeout)
        print(f"{args.lib}: {name}: {results[name]['status']} {results[name]['error']}", flush=True)
    if not args.scripts:
        for name, reason in SKIPPED.items():
            results[name] = {"status": "skipped", "reason": reason}
        for folder, reason in SKIPPED_FOLDERS.items():
            results[f"{folder}/"] = {"status": "skipped", "reason": reason}
    path = out / f"{args.lib}.json"
    if args.scripts and path.exists():  # a run of named scripts updates their entries of the last full run
        results = {**json.loads(path.read_text()), **results}
    path.write_text(json.dumps(results, indent=1) + "\n")
    print(f"trl_examples: {args.lib}: work folder {work}")
    return 0 if all(r["status"] in ("passed", "skipped") for r in results.values()) else 1


if __name__ == "__main__":
    if sys.argv[1:2] == ["--table"]:
        results = {lib: json.loads((Path(sys.argv[2]) / f"{lib}.json").read_text()) for lib in ("trl", "posttrain")}
        sys.stdout.write(table(results, sys.argv[3]))
        sys.exit(0)
    sys.exit(main())
