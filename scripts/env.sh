# Sourced by the scripts: offline Hugging Face, quiet tokenizers, tcmalloc when installed.
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
for lib in /usr/lib/*/libtcmalloc_minimal.so.4; do
  if [ -e "$lib" ]; then export LD_PRELOAD="${LD_PRELOAD:+$LD_PRELOAD:}$lib"; break; fi
done
