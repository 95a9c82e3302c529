"""TRL's `trl.scripts.vllm_serve` import path: `main(argv)` starts the vLLM server the online trainers talk to
(`posttrain vllm-serve MODEL [vllm flags]`); it lives in `posttrain.cli.vllm_serve`, with TRL's `ScriptArguments`
and `build_command` (posttrain's server command for TRL's options)."""

from posttrain.cli.vllm_serve import ScriptArguments, build_command, build_parser, main, make_parser

__all__ = ["ScriptArguments", "build_command", "build_parser", "main", "make_parser"]
