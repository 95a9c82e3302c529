"""TRL's `trl.scripts.vllm_serve` import path: `main(argv)` starts the vLLM server the online trainers talk to
(`posttrain vllm-serve MODEL [vllm flags]`); it lives in `posttrain.cli.vllm_serve`."""

from posttrain.cli.vllm_serve import build_parser, main, make_parser

__all__ = ["build_parser", "main", "make_parser"]
